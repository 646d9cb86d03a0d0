"""A fast fake of vLLM's OpenAI completions endpoint, for fault-injection tests and benchmarks.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies) for ``InferenceClient``:
``POST /v1/completions`` answers ``n`` completions of fixed tokens after ``latency_s`` (plus a
uniform random ``0..latency_jitter_s``, so that answers do not all arrive in lockstep), and
``GET /health`` answers 200. A ``faults`` plan decides, per request, whether to answer, to
answer every choice with ``finish_reason="abort"`` (what a paused-with-abort vLLM returns), or
to drop the connection without answering (a server restart, a proxy timeout).
``POST /reset_prefix_cache`` answers ``{"success": ...}`` as a ``resets`` plan says (vLLM's
refusal while KV blocks are held is ``false``), and records each query it was sent.

Not the real thing: tests of the real inference path run vLLM itself (tests/integration/infra). This
stands in where a test must inject faults deterministically or a benchmark must measure the
client side alone.

    python -m rollflow.testing.fake_openai --port 8000 --latency-s 0.05 [--latency-jitter-s 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Literal

from rollflow.inference.protocol import COMPLETIONS, HEALTH, RESET_PREFIX_CACHE
from rollflow.testing.loop_server import LoopServer

Fault = Literal["ok", "abort", "disconnect"]
FaultPlan = Callable[
    [tuple[int, ...], int], Fault
]  # (prompt token ids, attempt: 0, 1, ...) -> fault

# (attempt: 0, 1, ...) -> the reset's success (None: an answer without it)
ResetPlan = Callable[[int], bool | None]

COMPLETION = [5, 6, 7]


def no_faults(prompt: tuple[int, ...], attempt: int) -> Fault:
    return "ok"


def resets_succeed(attempt: int) -> bool:
    return True


class FakeOpenAI(LoopServer):
    """The server; ``start()`` runs it on its own loop thread and returns its base URL."""

    name, backlog = "fake-openai", 4096

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        faults: FaultPlan = no_faults,
        host: str = "127.0.0.1",
        port: int = 0,
        eos_token_id: int = 2,
        latency_jitter_s: float = 0.0,
        resets: ResetPlan = resets_succeed,
    ):
        super().__init__(host, port)
        self.latency_s, self.faults = latency_s, faults
        self.resets = resets
        self.reset_queries: list[str] = []  # the query of every /reset_prefix_cache, in order
        self.latency_jitter_s = latency_jitter_s
        self.eos_token_id = eos_token_id
        self.attempts: Counter[tuple[int, ...]] = Counter()  # requests seen per prompt
        self.injected: Counter[str] = Counter()  # faults served, by kind
        self.in_flight = self.max_in_flight = 0

    # ------------------------------------------------------------------ HTTP

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, target, body = request
                path, _, query = target.partition("?")
                if (method, path) == (HEALTH.method, HEALTH.path):
                    _respond(writer, 200, b"")
                elif (method, path) == (RESET_PREFIX_CACHE.method, RESET_PREFIX_CACHE.path):
                    success = self.resets(len(self.reset_queries))
                    self.reset_queries.append(query)
                    _respond(writer, 200, json.dumps({"success": success}).encode())
                elif (method, path) == (COMPLETIONS.method, COMPLETIONS.path):
                    answer = await self._complete(json.loads(body))
                    if answer is None:  # injected disconnect: no response, connection closed
                        return
                    _respond(writer, 200, json.dumps(answer).encode())
                else:
                    _respond(
                        writer, 404, json.dumps({"error": {"message": f"no route {path}"}}).encode()
                    )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _complete(self, body: dict) -> dict | None:
        prompt = tuple(body["prompt"])
        attempt = self.attempts[prompt]
        self.attempts[prompt] += 1
        fault = self.faults(prompt, attempt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency_s or self.latency_jitter_s:
                await asyncio.sleep(self.latency_s + random.uniform(0.0, self.latency_jitter_s))
        finally:
            self.in_flight -= 1
        if fault != "ok":
            self.injected[fault] += 1
        if fault == "disconnect":
            return None
        n, tokens = (
            int(body.get("n", 1)),
            [*COMPLETION[: body.get("max_tokens", 3) - 1], self.eos_token_id],
        )
        reason = "abort" if fault == "abort" else "stop"
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": body.get("model", "policy"),
            "choices": [
                {
                    "index": i,
                    "text": "",
                    "token_ids": tokens,
                    "finish_reason": reason,
                    "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                }
                for i in range(n)
            ],
        }


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return method, target, body


def _respond(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    reason = {200: "OK", 404: "Not Found"}[status]
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--latency-jitter-s", type=float, default=0.0)
    args = parser.parse_args()
    server = FakeOpenAI(
        latency_s=args.latency_s,
        latency_jitter_s=args.latency_jitter_s,
        host=args.host,
        port=args.port,
    )
    print(f"fake OpenAI server at {server.start()}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
