"""Rank 0's queue from the HTTP threads to the main thread, which runs one command at a time.

Owns: the order of commands. Invariant: commands run in submission order, one at a time; a
caller gets its own command's result, or, as soon as a failure is known, an error naming it;
never a wait past its deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from rollflow.infra.errors import ServiceError
from rollflow.trainer.control import PeerWatch


class Pending:
    """One queued command and, once it ran, its result or error."""

    def __init__(self, cmd: dict[str, Any]):
        self.cmd, self.done = cmd, threading.Event()  # {"op": name, "args": the request's JSON}
        self.result: Any = None
        self.error: BaseException | None = None

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Dispatcher:
    """Rank 0's queue from HTTP threads to the main thread (see the module's invariant)."""

    def __init__(self, watch: PeerWatch):
        self.watch = watch
        self._queue: queue.Queue[Pending] = queue.Queue()

    def enqueue(self, cmd: dict[str, Any]) -> Pending:
        if self.watch.failure:
            raise ServiceError(self.watch.failure, 503)
        pending = Pending(cmd)
        self._queue.put(pending)
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> Any:
        cmd = pending.cmd
        deadline = time.monotonic() + timeout_s
        while not pending.done.wait(0.05):
            if self.watch.failure:
                raise ServiceError(self.watch.failure, 503)
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {cmd['op']}: no result within {timeout_s:.0f}s")
        if pending.error is not None:
            raise pending.error
        return pending.result

    def next(self, wait_s: float) -> Pending | None:
        try:
            return self._queue.get(timeout=wait_s)
        except queue.Empty:
            return None
