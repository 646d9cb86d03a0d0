"""The order of a run's overlapping step flows: whose turn the trainer is, which step commits next.

Owns: the trainer order (step N trains once step N-1 released the trainer: its weights are out,
and its checkpoint and evaluation, if it has them, are done), the commit order (step N commits
once step N-1 committed), and the step clock (consecutive steps' ``step_s`` add up to the run's
wall clock). Step flows run in threads of the run flow's process; every method is thread-safe.

Invariant: ``close()`` ends every waiter at once (they raise, naming what they waited for), and
every wait has a deadline whose message says what was waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rollflow.infra.errors import TrainingFinished

_ORDERS: dict[str, StepOrder] = {}


class StepOrder:
    """The trainer order and the commit order of one run (see the module docstring)."""

    def __init__(self, run: str, resumed_from: int):
        self.run = run
        self._released = self._committed = self._synced = resumed_from
        self._released_at = self._last_step_end = time.perf_counter()
        self._closed: BaseException | None = None
        self._cond = threading.Condition()

    def __enter__(self) -> StepOrder:
        _ORDERS[self.run] = self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- trainer

    def wait_trainer(self, step: int, timeout_s: float) -> float:
        """Block until step ``step - 1`` released the trainer; returns when it did (perf_counter)."""
        self._wait(
            lambda: self._released >= step - 1,
            timeout_s,
            f"step {step} waited for step {step - 1} to release the trainer",
        )
        return self._released_at

    def release(self, step: int) -> None:
        """``step`` is done with the trainer and its weights: the next step may train (idempotent)."""
        with self._cond:
            if step > self._released:
                self._released, self._released_at = step, time.perf_counter()
            self._cond.notify_all()

    # -------------------------------------------------------------------- sync

    def wait_sync_turn(self, step: int, timeout_s: float) -> None:
        """Block until step ``step - 1``'s sync is done: weights reach vLLM in step order even
        when a step's sync runs after it released the trainer."""
        self._wait(
            lambda: self._synced >= step - 1,
            timeout_s,
            f"step {step} waited for step {step - 1}'s weight sync",
        )

    def synced(self, step: int) -> None:
        """``step``'s sync is done (or it had none)."""
        with self._cond:
            self._synced = max(self._synced, step)
            self._cond.notify_all()

    # ------------------------------------------------------------------ commit

    def wait_commit_turn(self, step: int, timeout_s: float) -> float:
        """Block until step ``step - 1`` committed; returns the step's seconds since the previous
        step's (or the start): consecutive steps add up to the run's wall clock."""
        self._wait(
            lambda: self._committed >= step - 1,
            timeout_s,
            f"step {step} waited for step {step - 1} to commit",
        )
        with self._cond:
            now = time.perf_counter()
            elapsed, self._last_step_end = now - self._last_step_end, now
            return elapsed

    def committed(self, step: int) -> None:
        with self._cond:
            self._committed = max(self._committed, step)
            self._cond.notify_all()

    # ------------------------------------------------------------------- close

    def close(self, reason: BaseException | None = None) -> None:
        """End every waiter, now and later (they raise, with ``reason`` as the cause)."""
        with self._cond:
            if self._closed is None:
                self._closed = reason or TrainingFinished("the run is closing")
            self._cond.notify_all()
        if _ORDERS.get(self.run) is self:
            del _ORDERS[self.run]

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: done() or self._closed is not None, timeout_s)
            if self._closed is not None:
                raise TrainingFinished(f"run closed: {what}") from self._closed
            if not ok:
                raise TimeoutError(f"{what} for {timeout_s:.0f}s")


def step_order(run: str) -> StepOrder:
    """The live step order of ``run`` in this process (step flows run inside its rl-run flow)."""
    try:
        return _ORDERS[run]
    except KeyError:
        raise RuntimeError(
            f"no step order for run {run!r} in this process; step flows run inside "
            "the rl-run flow, which keeps it"
        ) from None
