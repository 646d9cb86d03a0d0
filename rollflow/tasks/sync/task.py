"""The sync stage: trainer weights → vLLM as policy version N, while requests stay queued.

Order (``weights.publish``): pause generation (in-flight requests kept) → the trainer broadcasts
and vLLM receives, concurrently → reset the prefix cache → resume. Resume runs even when the
broadcast fails. A sync waits while the inference supervisor restarts vLLM; one cut by vLLM's
death is done again on the restarted server (whose re-sync already carried this version: the
second is a no-op).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.errors import InferenceError, ServiceError, WeightSyncError
from rollflow.infra.events import publish as publish_event
from rollflow.infra.inference.gate import serving_gate
from rollflow.tasks.sync.weights import WeightSource, publish

# How long a failed sync waits for the supervisor to notice a dead server (it checks every 5 s).
RESTART_NOTICE_S = 15.0


@dataclass(frozen=True)
class Synced:
    """One published policy version: where the time went and what was sent."""

    version: int
    pause_s: float
    broadcast_s: float
    total_s: float
    bytes: int | None
    attempts: int


@task(name="sync", cache_policy=NO_CACHE, persist_result=False)
def sync(ctx: RunContext, version: int, source: WeightSource) -> Synced:
    """Publish the trainer's (``source``'s) current weights to the inference deployment as ``version``."""
    timeout_s = ctx.config.trainer.weight_sync_timeout_s
    gate = serving_gate(ctx.inference.url)  # None when no supervisor runs the server
    for attempt in range(2):
        restarts_seen = gate.restarts if gate else 0
        try:
            with gate.weights_turn(timeout_s) if gate else contextlib.nullcontext():
                result = publish(source, ctx.inference.url, version, timeout_s)
            break
        except (WeightSyncError, InferenceError) as err:
            # A dead or hung trainer is no vLLM restart's to fix: fail at once, naming it.
            if (
                attempt
                or gate is None
                or _trainer_unreachable(err)
                or not gate.wait_restart(restarts_seen, RESTART_NOTICE_S)
            ):
                raise
    publish_event(ctx.storage, "weights_published", version=version)
    return Synced(
        result["version"],
        result["pause_s"],
        result["broadcast_s"],
        result["total_s"],
        result["bytes"],
        attempt + 1,
    )


def _trainer_unreachable(err: BaseException) -> bool:
    """The trainer's half of the sync failed without an answer, or answered that it failed (503)."""
    cause = err.__cause__
    return (
        isinstance(cause, ServiceError)
        and not isinstance(cause, InferenceError)
        and cause.status in (None, 503)
    )
