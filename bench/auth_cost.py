"""What the vLLM server's key check costs per request (inference/auth.py).

Two measurements, each against a baseline taken in the same run:

1. the middleware alone: an ASGI no-op app called directly vs. behind ``RunKeyMiddleware``
   (with the right key), N calls each, interleaved in rounds: microseconds per request;
2. a real vLLM server (CPU build, tiny model) with the middleware vs. one started the same way
   without it, both up at once, requests interleaved between them: median latency of
   ``GET /is_paused`` (a route that does nearly nothing, so the check's share is largest) and of
   a one-token ``POST /v1/completions``.

    .venv/bin/python bench/auth_cost.py [--skip-vllm]

Prints ratios (keyed / open). Takes ~1.5 min with the servers on 2 shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.inference import auth, protocol  # noqa: E402
from rollflow.infra.vllm_fleet import keys  # noqa: E402

KEY = "bench-key-" + "x" * 32


async def _noop(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def middleware_alone(num_calls: int = 20000, rounds: int = 5) -> tuple[float, float]:
    """Microseconds per call: (open, keyed)."""
    os.environ[protocol.KEY_ENV] = KEY
    keyed = auth.RunKeyMiddleware(_noop)
    scope = {
        "type": "http",
        "method": "POST",
        "path": protocol.COLLECTIVE_RPC.path,
        "headers": [(b"host", b"x"), (b"authorization", f"Bearer {KEY}".encode())],
    }

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    async def loop(app) -> float:
        start = time.perf_counter()
        for _ in range(num_calls):
            await app(scope, receive, send)
        return (time.perf_counter() - start) / num_calls * 1e6

    times: dict[str, list[float]] = {"open": [], "keyed": []}
    for _ in range(rounds):
        times["open"].append(asyncio.run(loop(_noop)))
        times["keyed"].append(asyncio.run(loop(keyed)))
    return min(times["open"]), min(times["keyed"])


def real_servers(num_requests: int = 200) -> dict[str, tuple[float, float]]:
    """Median ms per request, (open, keyed), by route, on two real vLLM servers."""
    import httpx

    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir
    from rollflow.services.vllm_server import InferenceServer

    class OpenServer(InferenceServer):
        """The same server without the key check (the baseline)."""

        def command(self) -> list[str]:
            cmd = super().command()
            i = cmd.index("--middleware")
            return cmd[:i] + cmd[i + 2 :]

    root = Path(tempfile.mkdtemp(prefix="auth-cost-"))
    tok = build_char_tokenizer()
    model = save_hf_dir(
        build_tiny_llama(TinyModelSpec(max_position_embeddings=64), vocab_size=len(tok)),
        tok,
        root / "model",
    )
    servers = {
        "open": OpenServer(model, max_model_len=64, log_path=root / "open.log"),
        "keyed": InferenceServer(model, max_model_len=64, log_path=root / "keyed.log"),
    }
    for server in servers.values():
        server.start()
    routes = {
        "GET /is_paused": (protocol.IS_PAUSED, None),
        "POST /v1/completions (1 token)": (
            protocol.COMPLETIONS,
            {"model": "policy", "prompt": [1, 10, 11], "max_tokens": 1, "temperature": 0.0},
        ),
    }
    out: dict[str, tuple[float, float]] = {}
    try:
        with httpx.Client(timeout=30) as http:
            for label, (route, body) in routes.items():
                lat: dict[str, list[float]] = {"open": [], "keyed": []}
                for i in range(num_requests + 10):
                    for name in ("open", "keyed") if i % 2 else ("keyed", "open"):
                        server = servers[name]
                        start = time.perf_counter()
                        response = http.request(
                            route.method,
                            server.url + route.path,
                            json=body,
                            headers=keys.auth_headers(server.url),
                        )
                        took = time.perf_counter() - start
                        assert response.status_code == 200, response.text
                        if i >= 10:  # warm-up
                            lat[name].append(took * 1e3)
                out[label] = (statistics.median(lat["open"]), statistics.median(lat["keyed"]))
    finally:
        for server in servers.values():
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm", action="store_true", help="the middleware alone only")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    open_us, keyed_us = middleware_alone()
    print(
        f"middleware alone: {open_us:.2f} us/call open, {keyed_us:.2f} us/call keyed: "
        f"+{keyed_us - open_us:.2f} us per request ({keyed_us / open_us:.2f}x a no-op ASGI app)"
    )
    if args.skip_vllm:
        return
    for label, (open_ms, keyed_ms) in real_servers().items():
        print(
            f"vLLM {label}: median {open_ms:.3f} ms open, {keyed_ms:.3f} ms keyed "
            f"(ratio {keyed_ms / open_ms:.3f}, {1e3 * (keyed_ms - open_ms):+.0f} us)"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
