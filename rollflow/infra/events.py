"""The run's events: one line each in ``events.jsonl`` (the record), mirrored as Prefect events.

Kinds: ``run_started``, ``weights_published(version)``, ``step_committed(step)``,
``training_finished`` (published by the trainer service after its last optimizer step). The run
flow's process is the only writer of ``events.jsonl``, so the object-store rewrite never races
another process; Prefect events (``rollflow.<kind>`` on resource ``rollflow.run.<run>``) let
automations react. A failure to mirror is logged, never fatal: the file is the record.
"""

from __future__ import annotations

import logging
from typing import Any

from rollflow.infra.storage import RunStorage

log = logging.getLogger(__name__)


def publish(storage: RunStorage, kind: str, **fields: Any) -> dict[str, Any]:
    """Record ``kind`` in the run's ``events.jsonl`` and emit it to Prefect."""
    event = storage.append_event(kind, **fields)
    try:
        from prefect.events import emit_event

        emit_event(
            event=f"rollflow.{kind}",
            resource={
                "prefect.resource.id": f"rollflow.run.{storage.run}",
                "prefect.resource.name": storage.run,
            },
            payload={k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)},
        )
    except Exception as exc:  # noqa: BLE001 - the record is written; the mirror is best effort
        log.warning("could not emit Prefect event rollflow.%s: %s", kind, exc)
    return event
