"""The sync stage: trainer weights → vLLM as policy version N, while requests stay queued.

Order: pause generation (in-flight requests kept) → the trainer broadcasts and vLLM receives,
concurrently → reset the prefix cache → resume. Resume runs even when the broadcast fails.
A sync waits while the inference supervisor restarts vLLM; one cut by vLLM's death is done again
on the restarted server (whose re-sync already carried this version: the second is a no-op).
"""

from __future__ import annotations

import asyncio
import contextlib

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.events import publish
from rollflow.infra.http import ServiceCallError, acall, async_client
from rollflow.infra.inference.client import InferenceClient, InferenceClientError
from rollflow.infra.inference.gate import serving_gate
from rollflow.infra.inference.sync import WeightSyncError, sync_weights

# How long a failed sync waits for the supervisor to notice a dead server (it checks every 5 s).
RESTART_NOTICE_S = 15.0


@task(name="sync", cache_policy=NO_CACHE, persist_result=False)
def sync(ctx: RunContext, version: int) -> dict:
    """Publish the trainer's current weights to the inference deployment as ``version``."""
    timeout_s = ctx.config.trainer.weight_sync_timeout_s
    gate = serving_gate(ctx.inference.url)  # None when no supervisor runs the server

    async def run() -> dict:
        client = InferenceClient(ctx.inference.url, timeout_s=timeout_s)
        async with async_client() as http:
            try:
                send = lambda: acall(http, ctx.trainer, "/weights/broadcast", {"version": version},  # noqa: E731
                                     timeout_s=timeout_s)
                return await sync_weights(client, send, version, timeout_s)
            finally:
                await client.aclose()

    for attempt in range(2):
        restarts_seen = gate.restarts if gate else 0
        try:
            with gate.weights_turn(timeout_s) if gate else contextlib.nullcontext():
                result = asyncio.run(run())
            break
        except (WeightSyncError, InferenceClientError) as err:
            # A dead or hung trainer is no vLLM restart's to fix: fail at once, naming it.
            if attempt or gate is None or _trainer_unreachable(err) \
                    or not gate.wait_restart(restarts_seen, RESTART_NOTICE_S):
                raise
    result["attempts"] = attempt + 1
    publish(ctx.storage, "weights_published", version=version)
    return result


def _trainer_unreachable(err: BaseException) -> bool:
    """The trainer's half of the sync failed without an answer, or answered that it failed (503)."""
    cause = err.__cause__
    return isinstance(cause, ServiceCallError) and cause.status in (None, 503)
