"""The serving gate: whether this process may send sampling requests to the inference server.

A restarted vLLM loads its weights from disk, which are not the policy version the run serves.
So while the inference supervisor restarts a server it closes the server's gate; every sampling
request of this process (the rollout producer, evaluation) waits at the gate instead of
reaching the new server, and the gate opens only once the restarted server holds the trainer's
published weights again. Weight-plane operations on the server (a step's sync, the supervisor's
re-join and re-sync) take turns through ``weights_turn``.

Invariants: no sampling request is sent while the gate is closed; a closed gate ends, within
the deadline given to ``close``, by ``open`` or by ``fail``, after which every waiter raises
``InferenceGone`` at once (or by ``retire``, for a server leaving the fleet: then
``InferenceUnavailable``, which is retried on another server). Gates are per process, registered by the server's base URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from rollflow.infra.errors import InferenceGone, InferenceUnavailable

_GATES: dict[str, ServingGate] = {}


class ServingGate:
    """Open, closed (a restart under way) or failed; see the module docstring."""

    def __init__(self, url: str, weights_lock: threading.Lock | None = None):
        self.url = url
        self.restarts = 0  # completed restarts of the server behind this gate
        self._cond = threading.Condition()
        # One weight group spans every server: their gates share one lock (``register_gate``).
        self._weights_lock = weights_lock or threading.Lock()
        self._open = True
        self._deadline = 0.0
        self._failed: str | None = None
        self._retired: str | None = None

    # ------------------------------------------------------------ the supervisor's side

    def close(self, deadline_s: float) -> None:
        """A restart begins; it will ``open`` or ``fail`` within ``deadline_s``."""
        with self._cond:
            self._open, self._deadline = False, time.monotonic() + deadline_s
            self._cond.notify_all()

    def open(self, restarted: bool = True) -> None:
        """The server holds published weights again: sampling may go on."""
        with self._cond:
            self.restarts += restarted
            self._open = True
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """The server is gone for good: every waiter, now and later, raises ``InferenceGone``."""
        with self._cond:
            self._failed, self._open = reason, False
            self._cond.notify_all()

    def retire(self, reason: str) -> None:
        """The server leaves the fleet while the run goes on: every waiter, now and later,
        raises ``InferenceUnavailable``, which the Sampler retries on another server."""
        with self._cond:
            self._retired, self._open = reason, False
            self._cond.notify_all()

    # -------------------------------------------------------------- the clients' side

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def restarting(self) -> bool:
        """A restart is under way: the server's unhealthiness is expected, not a death."""
        return not self._open and self._failed is None and self._retired is None

    def wait_open(self, timeout_s: float | None = None) -> None:
        """Block until the gate is open; ``InferenceGone`` if it failed, ``TimeoutError`` past the
        restart's deadline (or ``timeout_s``, whichever comes first)."""
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._open:
                self._raise_if_failed()
                now = time.monotonic()
                # A little past the supervisor's own deadline: it fails the gate itself by then.
                end = min(x for x in (self._deadline + 5.0, limit) if x is not None)
                if now >= end:
                    raise TimeoutError(
                        f"the inference server at {self.url} was still restarting "
                        f"after its deadline"
                    )
                self._cond.wait(min(end - now, 1.0))

    async def wait_open_async(self, timeout_s: float | None = None) -> None:
        """``wait_open`` for event-loop code (polls: the gate is closed only during a restart)."""
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._open:
            self._raise_if_failed()
            end = min(x for x in (self._deadline + 5.0, limit) if x is not None)
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"the inference server at {self.url} was still restarting after its deadline"
                )
            await asyncio.sleep(0.05)

    def wait_restart(self, restarts_seen: int, notice_s: float) -> bool:
        """After a failure against the server: was it restarted (or is it being restarted) since
        ``restarts_seen``? Waits ``notice_s`` for the supervisor to notice, then for the restart
        to end. True once the restarted server serves; False if no restart came."""
        with self._cond:
            noticed = self._cond.wait_for(
                lambda: self.restarts > restarts_seen or not self._open, notice_s
            )
        if not noticed:
            return False
        self.wait_open()
        return True

    @contextlib.contextmanager
    def weights_turn(self, timeout_s: float, *, when_open: bool = True) -> Iterator[None]:
        """Exclusive use of the server's weight plane: a step's sync waits for the gate to be open
        first (as long as a restart may take); the supervisor (``when_open=False``) takes its
        turn while the gate is closed. ``timeout_s`` bounds the wait for the other's turn."""
        if when_open:
            self.wait_open()
        if not self._weights_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the weight plane of {self.url} stayed busy for {timeout_s:.0f}s")
        try:
            yield
        finally:
            self._weights_lock.release()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise InferenceGone(self._failed)
        if self._retired is not None:
            raise InferenceUnavailable(self._retired)


def register_gate(url: str, weights_lock: threading.Lock | None = None) -> ServingGate:
    """A fresh gate for the server at ``url`` (its supervisor's); the servers of one weight group
    pass the group's ``weights_lock``, so that one sync or re-join at a time uses the group."""
    gate = _GATES[url.rstrip("/")] = ServingGate(url.rstrip("/"), weights_lock)
    return gate


def unregister_gate(gate: ServingGate) -> None:
    if _GATES.get(gate.url) is gate:
        del _GATES[gate.url]


def serving_gate(url: str) -> ServingGate | None:
    """The gate of the server at ``url`` in this process, or None when no supervisor runs it."""
    return _GATES.get(url.rstrip("/"))
