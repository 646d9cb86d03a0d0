"""The weight plane's orchestration: trainer (rank 0) → the vLLM server's workers.

Both sides of each collective must run at the same time: the trainer's half is an awaitable
factory (e.g. ``lambda: asyncio.to_thread(sender.broadcast, params, version)``) and the server's
half a ``/collective_rpc`` call; ``init_weight_group`` and ``sync_weights`` start them together
and bound the pair by a deadline. ``join``, ``publish``, ``rejoin`` and ``leave`` do the same
with the trainer service as the sender (any ``WeightSource``: the train stage's client is one),
for the run's services, the sync task and the inference supervisor's restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.service import free_port

logger = logging.getLogger(__name__)

# The workers' own collective timeout (timeout_s) must fire before vLLM's RPC timeout, so that
# the error that reaches the caller names the real cause ("could not join", "peer closed").
_RPC_MARGIN_S = 5.0


async def init_weight_group(
    client: InferenceClient,
    connect: Callable[[], Awaitable[Any]],
    host: str,
    port: int,
    world_size: int,
    timeout_s: float,
    metadata: list[dict[str, Any]],
    *,
    first_rank: int = 1,
) -> dict[str, Any]:
    """Form the weight group: the trainer's ``connect()`` and the server's workers join together.

    ``first_rank`` is the group rank of the server's first worker (its others follow).
    Returns ``{"ranks": [...], "init_s": ...}``.
    """
    start = time.perf_counter()
    rpc = client.collective_rpc(
        "init_weight_group",
        [host, port, first_rank, world_size, timeout_s, json.dumps(metadata)],
        timeout_s=timeout_s + _RPC_MARGIN_S,
    )
    _, ranks = await _together(connect(), rpc, timeout_s, "weight group set-up")
    return {"ranks": [int(r) for r in ranks], "init_s": time.perf_counter() - start}


async def sync_weights(
    client: InferenceClient,
    send: Callable[[], Awaitable[Any]],
    version: int | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Load policy ``version`` into the server in flight.

    pause(keep) → {trainer broadcast ∥ workers receive + reload} → reset prefix cache → resume.
    Requests in flight are frozen, not dropped, and continue on the new weights. The server is
    resumed whatever happens. Returns ``version``, ``pause_s``, ``broadcast_s``, ``total_s`` and
    ``bytes`` (what ``send()`` returned: an int, or a dict with a ``"bytes"`` key). With
    ``version=None`` the trainer tags the weights (``send()`` returns ``{"version": ...}``).
    """
    start = time.perf_counter()
    what = f"weight sync v{version}" if version is not None else "weight sync"
    await client.pause(mode="keep")
    paused = time.perf_counter()
    try:
        rpc = client.collective_rpc("receive_weights", timeout_s=timeout_s + _RPC_MARGIN_S)
        sent, versions = await _together(send(), rpc, timeout_s, what)
        broadcast_done = time.perf_counter()
        if version is None:
            version = sent.get("version") if isinstance(sent, dict) else None
        if any(int(v) != version for v in versions):
            raise WeightSyncError(f"workers loaded versions {versions}, expected {version}")
        # Cached KV blocks were computed by the old weights.
        await client.reset_prefix_cache()
    finally:
        await client.resume()
    end = time.perf_counter()
    return {
        "version": version,
        "pause_s": paused - start,
        "broadcast_s": broadcast_done - paused,
        "total_s": end - start,
        "bytes": _num_bytes(sent),
    }


async def _together(
    local: Awaitable[Any], remote: Awaitable[Any], timeout_s: float, what: str
) -> tuple[Any, Any]:
    """Run both halves of a collective; the first failure cancels the other."""
    local_task = asyncio.ensure_future(local)
    remote_task = asyncio.ensure_future(remote)
    try:
        async with asyncio.timeout(timeout_s + 2 * _RPC_MARGIN_S):
            return await asyncio.gather(local_task, remote_task)
    except TimeoutError as err:
        raise WeightSyncError(f"{what} did not finish within {timeout_s:.0f} s") from err
    except Exception as err:
        raise WeightSyncError(f"{what} failed: {err}") from err
    finally:
        for task in (local_task, remote_task):
            task.cancel()
        # A thread behind `local` cannot be cancelled; its own collective timeout ends it.
        await asyncio.gather(local_task, remote_task, return_exceptions=True)


def _num_bytes(sent: Any) -> int | None:
    if isinstance(sent, dict):
        sent = sent.get("bytes")
    return sent if isinstance(sent, int) else None


# ------------------------------------------------------------ with the trainer service


class WeightSource(Protocol):
    """The trainer's side of the weight plane (``tasks/train``'s ``TrainerClient`` is one)."""

    def metadata(self) -> list[dict[str, Any]]: ...

    def weights_connect(self, host: str, port: int, world_size: int, timeout_s: float) -> dict: ...

    def weights_broadcast(
        self, version: int | None = None, timeout_s: float | None = None
    ) -> dict: ...

    def weights_close(self, timeout_s: float | None = None) -> dict: ...

    def health(self, timeout_s: float = 5.0) -> dict: ...


def join(source: WeightSource, url: str, timeout_s: float) -> dict[str, Any]:
    """Form the weight group of the trainer (rank 0) and the server at ``url`` (its workers)."""
    metadata = source.metadata()
    port = free_port()

    async def run() -> dict[str, Any]:
        async with InferenceClient(url, timeout_s=timeout_s) as client:
            connect = partial(
                asyncio.to_thread, source.weights_connect, "127.0.0.1", port, 2, timeout_s
            )
            return await init_weight_group(
                client, connect, "127.0.0.1", port, 2, timeout_s, metadata
            )

    return asyncio.run(run())


def publish(
    source: WeightSource, url: str, version: int | None, timeout_s: float
) -> dict[str, Any]:
    """Broadcast the trainer's weights to the server as ``version`` (None: the trainer tags them
    with its last finished step); see ``sync_weights``."""

    async def run() -> dict[str, Any]:
        async with InferenceClient(url, timeout_s=timeout_s) as client:
            send = partial(asyncio.to_thread, source.weights_broadcast, version, timeout_s)
            return await sync_weights(client, send, version, timeout_s)

    return asyncio.run(run())


def rejoin(source: WeightSource, url: str, timeout_s: float, step_timeout_s: float) -> int:
    """A restarted server joins again and gets the weights of the trainer's last finished step
    (if the trainer is mid-step, after it: within ``step_timeout_s``). Returns that version.

    No new step can start training meanwhile: it would first need the previous step's sync,
    which waits for the serving gate the restart holds closed.
    """
    join(source, url, timeout_s)
    deadline = time.monotonic() + step_timeout_s
    while source.health().get("weights_version") is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer was still mid-step after {step_timeout_s:.0f}s")
        time.sleep(0.2)
    return publish(source, url, None, timeout_s)["version"]


def leave(source: WeightSource, url: str, timeout_s: float) -> None:
    """Close the weight group on both sides; a dead peer does not stop the other's close."""
    errors = []
    try:
        source.weights_close(timeout_s)
    except Exception as exc:  # noqa: BLE001 - teardown goes on
        errors.append(f"trainer: {exc}")

    async def close_workers() -> None:
        async with InferenceClient(url, timeout_s=timeout_s) as client:
            await client.collective_rpc("close_weight_group", [], timeout_s=timeout_s)

    try:
        asyncio.run(close_workers())
    except Exception as exc:  # noqa: BLE001
        errors.append(f"vLLM: {exc}")
    if errors:
        raise WeightSyncError("closing the weight group: " + "; ".join(errors))
