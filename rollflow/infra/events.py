"""The run's events: one line each in ``events.jsonl`` (the record), mirrored as Prefect events.

Kinds (``Event``, the one list of names; readers compare with its members): ``run_started``,
``weights_published(version)``, ``step_committed(step)``, ``inference_restarted(server)``,
``trainer_restarted``, ``fleet_changed(servers, joined | left)``, ``training_finished`` (published by the trainer service after its last optimizer step). The run
flow's process is the only writer of ``events.jsonl``, so the object-store rewrite never races
another process; Prefect events (``rollflow.<kind>`` on resource ``rollflow.run.<run>``) let
automations react. A failure to mirror is logged, never fatal: the file is the record. Where no
Prefect API is configured (a process that drives services without a run's API: no automation
can hear it), nothing is mirrored: Prefect's ``emit_event`` would start an ephemeral API server
of its own for it (seen in the suite: two per fleet test, one outlived its process).
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

from rollflow.infra.storage import RunStorage

log = logging.getLogger(__name__)


class Event(StrEnum):
    """The name of each kind of event, as ``events.jsonl`` and Prefect (``rollflow.<name>``) carry it."""

    RUN_STARTED = "run_started"
    WEIGHTS_PUBLISHED = "weights_published"
    STEP_COMMITTED = "step_committed"
    INFERENCE_RESTARTED = "inference_restarted"
    TRAINER_RESTARTED = "trainer_restarted"
    FLEET_CHANGED = "fleet_changed"  # a vLLM server joined or left the running run
    TRAINING_FINISHED = "training_finished"


def publish(storage: RunStorage, kind: Event, **fields: Any) -> dict[str, Any]:
    """Record ``kind`` in the run's ``events.jsonl`` and emit it to Prefect."""
    kind = Event(kind)
    event = storage.append_event(kind.value, **fields)
    try:
        from prefect.events import emit_event
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            return event

        emit_event(
            event=f"rollflow.{kind.value}",
            resource={
                "prefect.resource.id": f"rollflow.run.{storage.run}",
                "prefect.resource.name": storage.run,
            },
            payload={k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)},
        )
    except Exception as exc:  # noqa: BLE001 - the record is written; the mirror is best effort
        log.warning("could not emit Prefect event rollflow.%s: %s", kind.value, exc)
    return event


def has_event(storage: RunStorage, kind: Event) -> bool:
    """Whether the run's record holds an event of ``kind`` (e.g. ``TRAINING_FINISHED``)."""
    return any(e.get("event") == kind for e in storage.read_events())
