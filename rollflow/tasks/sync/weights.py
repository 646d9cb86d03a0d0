"""The weight plane's orchestration: trainer (rank 0) → the vLLM server's workers.

Both sides of each collective must run at the same time: the trainer's half is an awaitable
factory (e.g. ``lambda: asyncio.to_thread(sender.broadcast, params, version)``) and the server's
half a call of its workers (``infra/vllm_fleet/workers.WeightWorkers``); ``init_weight_group`` and
``sync_weights`` start them together and bound the pair by a deadline. ``join``, ``publish``,
``rejoin`` and ``leave`` do the same for every server of the deployment at once (one group: the
trainer is rank 0, each server's workers follow), with the trainer service as the sender (any
``WeightSource``: the train stage's client is one), for the run's services, the sync task and the
inference supervisor's restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.workers import WeightWorkers
from rollflow.trainer.protocol import HealthReply, OkReply, SentReply, TensorMeta

logger = logging.getLogger(__name__)

# The workers' own collective timeout (timeout_s) must fire before vLLM's RPC timeout, so that
# the error that reaches the caller names the real cause ("could not join", "peer closed").
_RPC_MARGIN_S = 5.0


@dataclass(frozen=True)
class GroupSpec:
    """What every member of the weight group agrees on; from the placement plan.

    ``world_size`` = 1 (the trainer) + every vLLM worker of every server; ``wire_device`` is
    ``plan.wire.device`` (``placement.choose_backend``): the trainer's sender and each worker
    put their bucket there, so both sides always pick the same backend.
    """

    world_size: int
    wire_device: str
    bucket_bytes: int
    host: str = "127.0.0.1"

    @classmethod
    def from_plan(cls, plan: Any, bucket_mb: float) -> GroupSpec:
        return cls(
            world_size=plan.weight_world_size,
            wire_device=plan.wire.device,
            bucket_bytes=int(bucket_mb * (1 << 20)),
            host=plan.group_host,
        )

    @classmethod
    def single(cls, bucket_bytes: int = 256 << 20) -> GroupSpec:
        """The trainer and one one-worker server on this host, over gloo (the CPU shape)."""
        return cls(world_size=2, wire_device="cpu", bucket_bytes=bucket_bytes)


async def init_weight_group(
    clients: Sequence[tuple[InferenceClient, int]],
    connect: Callable[[], Awaitable[Any]],
    spec: GroupSpec,
    port: int,
    timeout_s: float,
    metadata: list[dict[str, Any]],
) -> dict[str, Any]:
    """Form the weight group: the trainer's ``connect()`` and every server's workers join together.

    ``clients`` pairs each server's client with the group rank of its first worker (its others
    follow). Returns ``{"ranks": [...], "init_s": ...}``.
    """
    start = time.perf_counter()
    rpcs = [
        WeightWorkers(client).init_weight_group(
            host=spec.host,
            port=port,
            first_rank=first_rank,
            world_size=spec.world_size,
            group_timeout_s=timeout_s,
            metadata=metadata,
            wire_device=spec.wire_device,
            bucket_bytes=spec.bucket_bytes,
            timeout_s=timeout_s + _RPC_MARGIN_S,
        )
        for client, first_rank in clients
    ]
    _, *ranks = await _together(connect(), rpcs, timeout_s, "weight group set-up")
    return {"ranks": [r for rs in ranks for r in rs], "init_s": time.perf_counter() - start}


async def sync_weights(
    clients: Sequence[InferenceClient],
    send: Callable[[], Awaitable[SentReply]],
    version: int | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Load policy ``version`` into every server in flight.

    pause(keep) all → {trainer broadcast ∥ every worker receives + reloads} → reset prefix
    caches → resume all. Requests in flight are frozen, not dropped, and continue on the new
    weights: the reset preempts them, so that vLLM recomputes their KV with the new weights
    (``InferenceClient.reset_prefix_cache``), and no request, new or kept, reads KV of the old
    ones. A server that refuses the reset to the deadline fails the sync. Every server is
    resumed whatever happens. Returns ``version``, ``pause_s``, ``broadcast_s``, ``total_s``,
    ``bytes`` (what ``send()``'s reply says it sent) and ``cache_reset_tries`` (the most any
    server's reset took; 1: at once). With ``version=None`` the trainer tags the weights (the
    version its reply names).
    """
    start = time.perf_counter()
    what = f"weight sync v{version}" if version is not None else "weight sync"
    paused = []

    async def pause(client: InferenceClient) -> None:
        await client.pause(mode="keep")
        paused.append(client)

    try:
        # Together: each server's pause waits for its own forward pass in flight.
        pauses = await asyncio.gather(*(pause(c) for c in clients), return_exceptions=True)
        failed_pause = next((r for r in pauses if isinstance(r, BaseException)), None)
        if failed_pause is not None:
            raise failed_pause
        paused_at = time.perf_counter()
        rpcs = [
            WeightWorkers(client).receive_weights(timeout_s=timeout_s + _RPC_MARGIN_S)
            for client in clients
        ]
        sent, *versions = await _together(send(), rpcs, timeout_s, what)
        broadcast_done = time.perf_counter()
        if version is None:
            version = sent.version
        loaded = [v for vs in versions for v in vs]
        if any(v != version for v in loaded):
            raise WeightSyncError(f"workers loaded versions {loaded}, expected {version}")
        # Cached KV blocks were computed by the old weights, and so were the kept requests'.
        tries = await asyncio.gather(
            *(client.reset_prefix_cache(deadline_s=timeout_s) for client in clients)
        )
    finally:
        results = await asyncio.gather(
            *(client.resume() for client in paused), return_exceptions=True
        )
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise WeightSyncError(f"{what}: a server did not resume: {failed[0]}") from failed[0]
    end = time.perf_counter()
    return {
        "version": version,
        "pause_s": paused_at - start,
        "broadcast_s": broadcast_done - paused_at,
        "total_s": end - start,
        "bytes": sent.bytes,
        "cache_reset_tries": max(tries, default=0),
    }


async def _together(
    local: Awaitable[Any], remotes: Sequence[Awaitable[Any]], timeout_s: float, what: str
) -> list[Any]:
    """Run every half of a collective; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(local), *(asyncio.ensure_future(r) for r in remotes)]
    try:
        async with asyncio.timeout(timeout_s + 2 * _RPC_MARGIN_S):
            return await asyncio.gather(*tasks)
    except TimeoutError as err:
        raise WeightSyncError(f"{what} did not finish within {timeout_s:.0f} s") from err
    except Exception as err:
        raise WeightSyncError(f"{what} failed: {err}") from err
    finally:
        for task in tasks:
            task.cancel()
        # A thread behind `local` cannot be cancelled; its own collective timeout ends it.
        await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------ with the trainer service


class WeightSource(Protocol):
    """The trainer's side of the weight plane (``tasks/train``'s ``TrainerClient`` is one)."""

    def metadata(self) -> list[TensorMeta]: ...

    def weights_port(self) -> int: ...

    def weights_connect(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        wire_device: str,
        bucket_bytes: int,
    ) -> OkReply: ...

    def weights_broadcast(
        self, version: int | None = None, timeout_s: float | None = None
    ) -> SentReply: ...

    def weights_close(self, timeout_s: float | None = None) -> OkReply: ...

    def health(self, timeout_s: float = 5.0) -> HealthReply: ...


Servers = Sequence[tuple[str, int]]  # (url, group rank of its first worker), every server


def join(source: WeightSource, servers: Servers, spec: GroupSpec, timeout_s: float) -> dict:
    """Form the weight group of the trainer (rank 0) and every server's workers."""
    metadata = [m.model_dump() for m in source.metadata()]  # JSON to the servers' workers
    port = source.weights_port()  # on the host of the trainer's rank 0, which hosts the store

    async def run() -> dict[str, Any]:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                (await stack.enter_async_context(InferenceClient(url, timeout_s=timeout_s)), rank)
                for url, rank in servers
            ]
            connect = partial(
                asyncio.to_thread,
                source.weights_connect,
                spec.host,
                port,
                spec.world_size,
                timeout_s,
                spec.wire_device,
                spec.bucket_bytes,
            )
            return await init_weight_group(clients, connect, spec, port, timeout_s, metadata)

    return asyncio.run(run())


def publish(
    source: WeightSource, urls: Sequence[str], version: int | None, timeout_s: float
) -> dict[str, Any]:
    """Broadcast the trainer's weights to every server as ``version`` (None: the trainer tags them
    with its last finished step); see ``sync_weights``."""

    async def run() -> dict[str, Any]:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(InferenceClient(url, timeout_s=timeout_s))
                for url in urls
            ]
            send = partial(asyncio.to_thread, source.weights_broadcast, version, timeout_s)
            return await sync_weights(clients, send, version, timeout_s)

    return asyncio.run(run())


def rejoin(
    source: WeightSource, servers: Servers, spec: GroupSpec, timeout_s: float, step_timeout_s: float
) -> int:
    """Form the group anew after a server restarted, and give every server the weights of the
    trainer's last finished step (if the trainer is mid-step, after it: within
    ``step_timeout_s``). Returns that version.

    A group's membership is fixed when it forms, so a restarted member means a new group: the
    servers that kept running rejoin too (they keep serving meanwhile) and load the same
    version again. No new step can start training meanwhile: it would first need the previous
    step's sync, which waits for the serving gate the restart holds closed.
    """
    join(source, servers, spec, timeout_s)
    deadline = time.monotonic() + step_timeout_s
    while source.health().weights_version is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer was still mid-step after {step_timeout_s:.0f}s")
        time.sleep(0.2)
    return publish(source, [url for url, _ in servers], None, timeout_s)["version"]


def leave(source: WeightSource, urls: Sequence[str], timeout_s: float) -> None:
    """Close the weight group on every side; a dead peer does not stop the others' close."""
    errors = []
    try:
        source.weights_close(timeout_s)
    except Exception as exc:  # noqa: BLE001 - teardown goes on
        errors.append(f"trainer: {exc}")

    async def close_workers(url: str) -> None:
        async with InferenceClient(url, timeout_s=timeout_s) as client:
            await WeightWorkers(client).close_weight_group(timeout_s=timeout_s)

    for url in urls:
        try:
            asyncio.run(close_workers(url))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"vLLM at {url}: {exc}")
    if errors:
        raise WeightSyncError("closing the weight group: " + "; ".join(errors))
