"""Fault points: places where the chaos tests can SIGKILL or hang a process at an exact moment.

Some moments are too short to hit from outside (a tiny model's checkpoint uploads, and its
weights broadcast, in milliseconds; a whole tiny step takes a third of a second). ``fault_point``
acts on its own process when the environment arms that point: ``ROLLFLOW_FAULT=<name>@<n>``
fires on the n-th time the point is reached in that process (``@1`` if omitted), or, for a
point that passes a step, at step n. It SIGKILLs the process, or, with ``:stop`` after it,
SIGSTOPs it: the process hangs, alive and answering nothing, as a rank stuck in a collective on a
GPU does, until someone kills it. A point that counts steps fires once per run even across
restarts: a trainer restarted from step n's checkpoint never passes step n again. Unarmed
(always, outside the tests) a point costs one dictionary lookup. The points are listed in
``POINTS``.
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_ENV = "ROLLFLOW_FAULT"
POINTS = {
    "checkpoint_upload": "trainer rank 0, after the first file of a checkpoint is uploaded",
    "weight_broadcast": "trainer rank 0, after a broadcast's header, before its weights",
    "after_checkpoint": "a trainer rank, as it takes its first command after step n's "
    "checkpoint (n: the step)",
}
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def parse(value: str) -> tuple[str, int, signal.Signals] | None:
    """``<name>@<n>[:kill|:stop]`` as (name, n, signal); None for an empty value."""
    if not value:
        return None
    armed, _, action = value.partition(":")
    name, _, nth = armed.partition("@")
    if name not in POINTS or action not in ("", *ACTIONS) or not (nth or "1").isdigit():
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected <point>@<n>[:kill|:stop], a point among "
            f"{sorted(POINTS)}"
        )
    return name, int(nth or 1), ACTIONS[action or "kill"]


_ARMED = parse(os.environ.get(FAULT_ENV, ""))
_hits: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(name: str, step: int | None = None) -> None:
    """Act on this process if the environment armed ``name`` and this is its n-th passage (or,
    with ``step``, step n)."""
    if _ARMED is None or _ARMED[0] != name:
        return
    if step is None:
        with _lock:
            _hits[name] = _hits.get(name, 0) + 1
            step = _hits[name]
    if step == _ARMED[1]:
        os.kill(os.getpid(), _ARMED[2])
