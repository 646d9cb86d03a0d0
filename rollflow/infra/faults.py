"""Fault points: places where the chaos tests can SIGKILL a process at an exact moment.

Some moments are too short to hit from outside (a tiny model's checkpoint uploads, and its
weights broadcast, in milliseconds). ``fault_point(name)`` kills its own process with SIGKILL
when the environment arms that point: ``ROLLFLOW_FAULT=<name>@<n>`` fires on the n-th time the
point is reached in that process (``@1`` if omitted). Unarmed (always, outside the tests) a
point costs one dictionary lookup. The named points are listed in ``POINTS``.
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_ENV = "ROLLFLOW_FAULT"
POINTS = {
    "checkpoint_upload": "trainer rank 0, after the first file of a checkpoint is uploaded",
    "weight_broadcast": "trainer rank 0, after a broadcast's header, before its weights",
}

_name, _, _nth = (os.environ.get(FAULT_ENV) or "").partition("@")
_ARMED = {_name: int(_nth or 1)} if _name else {}
_hits: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(name: str) -> None:
    """SIGKILL this process if the environment armed ``name`` and this is its n-th hit."""
    if name not in _ARMED:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        fire = _hits[name] == _ARMED[name]
    if fire:
        os.kill(os.getpid(), signal.SIGKILL)
