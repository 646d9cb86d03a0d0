"""The sync stage: trainer weights → vLLM as policy version N, while requests stay queued.

Order (``weights.publish``): pause generation (in-flight requests kept) → the trainer broadcasts
and vLLM receives, concurrently → reset the prefix cache (the kept requests preempted, their KV
recomputed with the new weights; a refusal to the deadline fails the sync) → resume. Resume runs
even when the broadcast fails. A sync waits while the inference supervisor restarts vLLM; one cut by vLLM's
death is done again on the restarted server (whose re-sync already carried this version: the
second is a no-op).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.errors import InferenceError, ServiceError, WeightSyncError
from rollflow.infra.events import Event
from rollflow.infra.events import publish as publish_event
from rollflow.infra.vllm_fleet.fleet import Fleet
from rollflow.infra.vllm_fleet.gate import ServingGate, serving_gate
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
    cache_reset_tries: int  # the most tries a server's prefix-cache reset took (1: at once)


@task(name="sync", cache_policy=NO_CACHE, persist_result=False)
def sync(ctx: RunContext, version: int, source: WeightSource) -> Synced:
    """Publish the trainer's (``source``'s) current weights to the inference deployment as ``version``."""
    timeout_s = ctx.config.trainer.weight_sync_timeout_s
    fleet = ctx.inference_fleet()
    for attempt in range(2):
        # None where no supervisor runs the server; a run's gates share one weight-plane lock.
        gates = [g for g in map(serving_gate, fleet.urls()) if g is not None]
        seen = _FleetState.of(fleet, gates)
        try:
            with _weights_turn(gates, timeout_s):
                # Read under the group's lock: the fleet changes only under it, so these are
                # exactly the group's servers (one that joined meanwhile included).
                result = publish(source, fleet.urls(), version, timeout_s)
            break
        except (WeightSyncError, InferenceError) as err:
            # A dead or hung trainer is no vLLM restart's to fix: fail at once, naming it.
            if (
                attempt
                or not gates
                or _trainer_unreachable(err)
                or not seen.changed(RESTART_NOTICE_S)
            ):
                raise
    publish_event(ctx.storage, Event.WEIGHTS_PUBLISHED, version=version)
    return Synced(
        result["version"],
        result["pause_s"],
        result["broadcast_s"],
        result["total_s"],
        result["bytes"],
        attempt + 1,
        result["cache_reset_tries"],
    )


@contextlib.contextmanager
def _weights_turn(gates: list[ServingGate], timeout_s: float) -> Iterator[None]:
    """The weight plane of every server: all gates open, then the group's one lock."""
    if not gates:
        yield
        return
    for gate in gates[1:]:
        gate.wait_open()
    with gates[0].weights_turn(timeout_s):  # waits for gates[0] to open, takes the shared lock
        yield


@dataclass(frozen=True)
class _FleetState:
    """The servers and their restarts when a sync began, to tell whether a failed sync met a
    restart or a change of the fleet (a server preempted and taken out), which heal it."""

    fleet: Fleet
    members: dict[int, str]
    gates: list[ServingGate]
    restarts: list[int]

    @classmethod
    def of(cls, fleet: Fleet, gates: list[ServingGate]) -> _FleetState:
        return cls(fleet, fleet.members(), gates, [g.restarts for g in gates])

    def changed(self, notice_s: float) -> bool:
        """Was any server restarted (or is one being restarted), or did the fleet change, since
        then? Waits ``notice_s`` for the run's services to notice, then for every restart to
        end."""
        deadline = time.monotonic() + notice_s
        while not (
            self.fleet.members() != self.members
            or any(
                g.restarts > s or not g.is_open
                for g, s in zip(self.gates, self.restarts, strict=True)
            )
        ):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        for gate in map(serving_gate, self.fleet.urls()):
            if gate is not None:
                gate.wait_open()
        return True


def _trainer_unreachable(err: BaseException) -> bool:
    """The trainer's half of the sync failed without an answer, or answered that it failed (503)."""
    cause = err.__cause__
    return (
        isinstance(cause, ServiceError)
        and not isinstance(cause, InferenceError)
        and cause.status in (None, 503)
    )
