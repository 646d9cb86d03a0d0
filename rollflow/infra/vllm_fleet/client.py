"""Async client of the vLLM OpenAI server: token-in/token-out sampling and the RL control calls.

Prompts go in as token ids and completions come back as token ids with the logprob of each
sampled token, so nothing is ever re-tokenised. Every call carries a timeout.

Sampling waits at the server's serving gate (``gate.py``) while its supervisor restarts it, so
a restarted server is never sampled before it holds the run's weights again.

The transport is aiohttp, not httpx: the producer keeps hundreds of requests in flight on one
event loop, and httpcore 1.0.9's connection pool rescans every connection on each request and
response (quadratic in connections; with ``max_keepalive_connections`` below
``max_connections`` it also closes idle connections it should keep). Measured with
``bench/event_loop.py``: ~13 ms of loop CPU per request with httpx against ~0.4 ms with aiohttp,
and with 1024 requests in flight the httpx pool held the loop for more than 10 s at a time.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from rollflow.inference import protocol
from rollflow.inference.protocol import Route
from rollflow.infra.errors import (
    InferenceError,
    InferenceUnavailable,
    PrefixCacheNotReset,
    RequestAborted,
)
from rollflow.infra.vllm_fleet.gate import serving_gate
from rollflow.infra.vllm_fleet.keys import auth_headers

# vLLM's uvicorn closes a keep-alive connection after 5 s idle (--timeout-keep-alive); the client
# drops its own a little earlier, so that it rarely sends on a connection the server is closing.
_KEEPALIVE_S = 4.0
# The first wait before a refused prefix-cache reset is tried again (it doubles, up to 1 s).
_RESET_RETRY_S = 0.05


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its tokens, the logprob of each, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop token) or "length"


class InferenceClient:
    """Talks to one vLLM server started with ``VLLM_SERVER_DEV_MODE=1``.

    Invariant: every call returns or raises within its timeout; failures are typed
    (``InferenceUnavailable``, ``RequestAborted``, or ``InferenceError`` with the HTTP status of
    a 4xx or 5xx answer), never a bare ``aiohttp`` error. Create and use it on one event loop.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "policy",
        timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        max_connections: int = 256,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # The server's key (keys.py): given, or the one of the server this process started there.
        self._headers = auth_headers(self.base_url, api_key)
        self.model = model
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the loop

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, keepalive_timeout=_KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions of a token-id prompt (after waiting out a restart, if any).

        Raises ``InferenceGone`` when the server's supervisor gave up on it.
        """
        gate = serving_gate(self.base_url)
        if gate is not None and not gate.is_open:
            try:
                await gate.wait_open_async(timeout_s or self.timeout_s)
            except TimeoutError as err:
                raise InferenceUnavailable(str(err)) from err
        body = completion_request(self.model, prompt_ids, n, max_tokens, temperature, top_p, seed)
        data = await self._post(
            protocol.COMPLETIONS, body=body, timeout_s=timeout_s or self.timeout_s
        )
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return [_completion(c) for c in choices]

    async def pause(self, mode: str = "keep") -> None:
        """Stop scheduling; ``keep`` freezes in-flight requests, ``abort`` ends them, ``wait`` drains.

        The pause leaves vLLM's caches alone (``clear_cache=false``). vLLM 0.32 clears them by
        default even for ``keep``, preempting the requests in flight, though it documents the
        parameter as deprecated and ignored for ``keep``; a weight sync does not lean on that:
        its one reset is ``reset_prefix_cache``, after the new weights are in, and it is checked.
        """
        await self._post(protocol.PAUSE, params={"mode": mode, "clear_cache": "false"})

    async def resume(self) -> None:
        """Resume scheduling after ``pause``."""
        await self._post(protocol.RESUME)

    async def reset_prefix_cache(self, *, deadline_s: float | None = None) -> int:
        """Drop every cached KV block (after a weight sync: they were computed by the old weights).

        Requests in flight hold blocks, and vLLM refuses a reset while any block is held; so the
        reset preempts them (``reset_running_requests``): they go back to vLLM's queue keeping
        their tokens, and their KV is recomputed, by the new weights, when they are scheduled
        again. None is lost, and no KV of the old weights is used again. vLLM answers
        ``{"success": false}`` when blocks are held even so (an asynchronous KV transfer); the
        reset is then tried again until ``deadline_s`` (the control timeout), then raises
        ``PrefixCacheNotReset``. Returns the tries it took (1: at once).
        """
        deadline_s = deadline_s or self.control_timeout_s
        deadline = time.monotonic() + deadline_s
        tries, wait_s = 1, _RESET_RETRY_S
        while not await self._reset_prefix_cache_once():
            if time.monotonic() + wait_s > deadline:
                raise PrefixCacheNotReset(
                    f"{self.base_url} refused to reset its prefix cache {tries} times within "
                    f"{deadline_s:.0f} s (KV blocks still held): KV computed by the old weights "
                    "could be used again; see the server's log"
                )
            await asyncio.sleep(wait_s)
            tries, wait_s = tries + 1, min(2 * wait_s, 1.0)
        return tries

    async def _reset_prefix_cache_once(self) -> bool:
        route = protocol.RESET_PREFIX_CACHE
        answer = await self._post(route, params={"reset_running_requests": "true"})
        try:
            return protocol.PrefixCacheReset.model_validate(answer).success
        except ValidationError as err:  # e.g. an older vLLM's empty 200, which said nothing
            raise InferenceError(f"{route.path} answered {answer!r}, not its success") from err

    async def collective_rpc(
        self, method: str, args: list[str], *, timeout_s: float | None = None
    ) -> list[Any]:
        """Call ``method`` of every worker (the worker extension); returns one result per worker.

        Arguments are strings: vLLM accepts nothing else on this endpoint. ``workers.py`` makes
        the typed calls of rollflow's worker methods.
        """
        timeout_s = timeout_s or self.control_timeout_s
        body = protocol.CollectiveRpc(method=method, args=args, timeout=timeout_s).model_dump()
        # Never re-sent: a worker method may have run even if the connection broke.
        data = await self._post(
            protocol.COLLECTIVE_RPC, body=body, timeout_s=timeout_s + 5.0, resend_on_stale=False
        )
        return (data or {}).get("results", [])

    @property
    def restarting(self) -> bool:
        """Whether the server's supervisor is restarting it now (it is expected to be down)."""
        gate = serving_gate(self.base_url)
        return gate is not None and gate.restarting

    async def health(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers ``/health`` with 200."""
        for attempt in range(2):  # the first try may meet a pooled connection the server closed
            try:
                async with self._http().get(
                    self.base_url + protocol.HEALTH.path,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as response:
                    await response.read()
                    return response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                if attempt:
                    return False
        return False

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _post(
        self,
        route: Route,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        resend_on_stale: bool = True,
    ) -> Any:
        timeout_s = timeout_s or self.control_timeout_s
        what = f"{route.method} {route.path}"
        undeclared = set(params or ()) - set(route.params)
        if undeclared:  # the protocol declares what the run sends to vLLM
            raise ValueError(f"{what} takes no query parameter {sorted(undeclared)}")
        try:
            try:
                status, data = await self._send(route, body, params, timeout_s)
            except _STALE_CONNECTION as err:
                # uvicorn closes a connection after an unhandled error (vLLM's /collective_rpc
                # raises one for a failed worker call), or after its keep-alive timeout; the pool
                # may hand that connection out once more. Sampling and pause/resume are safe to
                # send again.
                if not resend_on_stale or isinstance(err, aiohttp.ClientConnectorError):
                    raise
                status, data = await self._send(route, body, params, timeout_s)
        except TimeoutError as err:
            raise InferenceUnavailable(f"{what} timed out after {timeout_s:.0f} s") from err
        except aiohttp.ClientError as err:
            raise InferenceUnavailable(f"{what} to {self.base_url} failed: {err!r}") from err
        if status >= 400:
            raise InferenceError(f"HTTP {status}: {_error_message(data)}", status)
        if not data:
            return None
        return json.loads(data)

    async def _send(
        self,
        route: Route,
        body: dict[str, Any] | None,
        params: dict[str, Any] | None,
        timeout_s: float,
    ) -> tuple[int, bytes]:
        async with self._http().request(
            route.method,
            self.base_url + route.path,
            json=body,
            params=params,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            return response.status, await response.read()


# A connection that broke under a request. (ClientConnectorError, a connection that could not be
# opened, is a ClientOSError too, and no reason to try again at once.)
_STALE_CONNECTION = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientOSError,
)


def completion_request(
    model: str,
    prompt_ids: list[int],
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The body of a ``/v1/completions`` request the run sends: token ids in, ``n`` samples'
    token ids and their log-probs out, and no text."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        # logprobs=0: only the sampled token's logprob, no top-k alternatives to ship.
        "logprobs": 0,
        "return_token_ids": True,
        # Nothing reads text: the server turns no token into a string (inference/plugin.py),
        # and the log-probs name their tokens by id ("token_id:42").
        "vllm_xargs": {protocol.TOKEN_IDS_ONLY: 1},
        "return_tokens_as_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def _completion(choice: dict[str, Any]) -> Completion:
    if choice.get("finish_reason") == "abort":
        raise RequestAborted("generation aborted by the server")
    token_ids = [int(t) for t in choice["token_ids"]]
    raw = (choice.get("logprobs") or {}).get("token_logprobs") or []
    logprobs = [float(x) if x is not None else math.nan for x in raw]
    if len(logprobs) != len(token_ids):
        raise InferenceError(
            f"server returned {len(token_ids)} tokens but {len(logprobs)} logprobs"
        )
    return Completion(token_ids, logprobs, choice["finish_reason"])


def _error_message(body: bytes) -> str:
    # vLLM answers {"error": {"message": ...}}, FastAPI {"detail": ...}, /pause {"error": "..."}.
    try:
        data = json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return body.decode("utf-8", "replace")[:2000]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
    return str(data)[:2000]
