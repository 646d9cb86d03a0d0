"""The inference fleet: which vLLM servers serve the run now.

The run's services own it and change it (``services/fleet_keeper.py``:
``FleetKeeper.reconcile``); every part of the run's process that talks to vLLM follows it: the
producer's ``InferencePool`` leases only its members, the sync task publishes to exactly its
members. A server is a member once it is in the weight group and holds the policy the others
serve, and stops being one before it is stopped, so nothing samples from a server that is joining or leaving.

Servers are named by their slot in the placement plan (``inference.max_servers`` slots): slot
``i`` always has the same devices, cores and port (``inference.port + i``), so its metrics
(``inference/<i>/...``) mean one server's place across the run.

Invariants: members change only under the weight group's lock (the run's services hold it),
so a sync that reads them under that lock publishes to exactly the group's servers; readers get
copies. Fleets are per process, registered by run name, like the serving gates by URL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflow.infra.storage import RunStorage

_FLEETS: dict[str, Fleet] = {}
_LOCK = threading.Lock()


class Fleet:
    """The serving servers, slot → base URL, and when each joined."""

    def __init__(self, servers: Mapping[int, str] | Sequence[str] = ()):
        if not isinstance(servers, Mapping):
            servers = dict(enumerate(servers))
        self._lock = threading.Lock()
        self._members = {i: url.rstrip("/") for i, url in servers.items()}
        self.joined_at = {i: time.monotonic() for i in self._members}

    def members(self) -> dict[int, str]:
        """slot → URL, in slot order (a copy)."""
        with self._lock:
            return dict(sorted(self._members.items()))

    def urls(self) -> list[str]:
        return list(self.members().values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._members)

    def add(self, slot: int, url: str) -> None:
        """Server ``slot`` serves from now on (it holds the policy the others serve)."""
        with self._lock:
            self._members[slot] = url.rstrip("/")
            self.joined_at[slot] = time.monotonic()

    def remove(self, slot: int) -> None:
        """Server ``slot`` gets no request from now on (requests in flight on it are retried)."""
        with self._lock:
            self._members.pop(slot, None)


def register_fleet(run: str, fleet: Fleet) -> Fleet:
    with _LOCK:
        _FLEETS[run] = fleet
    return fleet


def unregister_fleet(run: str, fleet: Fleet) -> None:
    with _LOCK:
        if _FLEETS.get(run) is fleet:
            del _FLEETS[run]


def fleet_of(run: str) -> Fleet | None:
    """The fleet of run ``run`` in this process, or None where its services run elsewhere."""
    with _LOCK:
        return _FLEETS.get(run)


# ------------------------------------------------------------------ the control file

FLEET_CONTROL = "control/fleet.json"  # in the run's storage: the size the fleet is asked to be
FLEET_STATE = "control/fleet-state.json"  # written by the run: its slots and serving servers


def record_fleet(storage: RunStorage, slots: int, fleet: Fleet) -> None:
    """The run's own word on its fleet: how many slots its plan has (a rerun may be placed for
    more or fewer than the first config says) and which serve now."""
    storage.write_json(FLEET_STATE, {"slots": slots, "serving": list(fleet.members())})


def ask_for_servers(storage: RunStorage, servers: int, by: str) -> dict:
    """Ask the running run (or its next rerun) for ``servers`` vLLM servers; the run's health
    loop reads the file every few seconds (``FleetKeeper.reconcile``)."""
    asked = {"servers": servers, "asked_at": time.time(), "by": by}
    storage.write_json(FLEET_CONTROL, asked)
    return asked


def asked_servers(storage: RunStorage) -> int | None:
    """The size the fleet is asked to be (None: never asked); ``ValueError`` naming the file
    when it holds no such number (edited by hand)."""
    try:
        asked = storage.read_json(FLEET_CONTROL)
    except ValueError as exc:
        raise ValueError(
            f"{storage.path(FLEET_CONTROL)} is not JSON ({exc}): write it with "
            "`rollflow scale RUN --servers N`"
        ) from exc
    if asked is None:
        return None
    servers = asked.get("servers") if isinstance(asked, dict) else None
    if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
        raise ValueError(
            f'{storage.path(FLEET_CONTROL)} holds {asked!r}, not {{"servers": N}} with N >= 1: '
            "write it with `rollflow scale RUN --servers N`"
        )
    return servers


def scale_run(
    run: str,
    servers: int,
    storage_root: str = "runs",
    options: dict[str, Any] | None = None,
    by: str = "rollflow scale",
) -> str:
    """Ask run ``run`` (in ``storage_root``) for ``servers`` vLLM servers; returns what was done.
    Raises ``InputError`` naming what is wrong (no such run, no room for N, a finished run),
    having written nothing. ``rollflow scale`` and the ``rollflow-scale`` deployment call it."""
    from rollflow.infra.config import ConfigError, validate_config
    from rollflow.infra.errors import InputError
    from rollflow.infra.events import Event, has_event
    from rollflow.infra.storage import RunStorage

    storage = RunStorage(storage_root, run, options)
    config = storage.read_json("config.json")
    if config is None:
        raise InputError(
            f"no run {run!r} in {storage.uri} (no config.json); is the storage the run's "
            "run.storage?"
        )
    state = storage.read_json(FLEET_STATE)  # the running (or last) launch's plan
    if isinstance(state, dict) and isinstance(state.get("slots"), int):
        slots = state["slots"]
    else:  # not started yet: its first config's
        try:
            slots = validate_config(config).inference.fleet_slots()
        except ConfigError as exc:
            raise InputError(f"{storage.path('config.json')}: {exc}") from None
    if not 1 <= servers <= slots:
        raise InputError(
            f"{servers} server(s): run {run!r} has room for 1 to {slots} server(s) "
            "(inference.max_servers); a run placed for more must be started with a higher "
            "inference.max_servers"
        )
    if has_event(storage, Event.TRAINING_FINISHED):
        raise InputError(f"run {run!r} has finished training: there is no fleet to scale")
    ask_for_servers(storage, servers, by=by)
    return (
        f"asked run {run!r} for {servers} vLLM server(s) ({storage.path(FLEET_CONTROL)}); a "
        "running run applies it within seconds (its log says when, events.jsonl records "
        "fleet_changed), a rerun starts with it"
    )
