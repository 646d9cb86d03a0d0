"""The order of a run's overlapping step flows: whose turn the trainer is, which step commits next.

Owns: the start order (the first step's flow run is created alone, the others' once it trains),
each step's schedule (``StepSchedule``: whether it evaluates, checkpoints, syncs, at which
point of its flow it releases the trainer), the trainer order (step N trains once step N-1
released the trainer: its weights are out, and its checkpoint and evaluation, if it has them, are
done), the sync order (step N's weights reach vLLM after step N-1's), the commit order (step N
commits once step N-1 committed), and the step clock (consecutive steps' ``step_s`` add up to the
run's wall clock). Step flows run in threads of the run flow's process, which hands its order to
each (a live object, not looked up); every method is thread-safe.

Invariant: ``close()`` ends every waiter at once (they raise, naming what they waited for), and
every wait has a deadline whose message says what was waited for.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import TrainingFinished


class Phase(enum.Enum):
    """The points of a step's flow after which it may release the trainer."""

    TRAINED = "trained"  # its optimizer steps are done (and its weights captured, if it syncs)
    SYNCED = "synced"  # its weights are in vLLM
    CHECKPOINTED = "checkpointed"  # its checkpoint (and evaluation) saw its weights


@dataclass(frozen=True)
class StepSchedule:
    """What one step does, and when the next step may train: one decision, from the config."""

    evaluates: bool
    checkpoints: bool
    syncs: bool
    # Optimizer steps before the step's end at which its weights go to vLLM (0: at its end).
    lag: int
    # The weights are captured on the trainer at ``TRAINED`` so that their broadcast runs while
    # the next step trains (``trainer.background_sync``).
    captures: bool
    releases_after: Phase

    @classmethod
    def of(cls, cfg: RunConfig, step: int) -> StepSchedule:
        evaluates = step == cfg.run.num_steps or bool(
            cfg.run.eval_every and step % cfg.run.eval_every == 0
        )
        checkpoints = step % cfg.run.checkpoint_every == 0 or step == cfg.run.num_steps
        syncs = step % cfg.train.sync_every == 0 or evaluates
        lag = 0 if evaluates else cfg.train.sync_lag()  # evaluation sees the whole step
        syncs_at_end = syncs and not lag
        if evaluates or checkpoints:  # they must see this step's weights
            releases_after = Phase.CHECKPOINTED
        elif syncs_at_end and not cfg.trainer.background_sync:
            releases_after = Phase.SYNCED
        else:
            releases_after = Phase.TRAINED
        captures = syncs_at_end and releases_after is Phase.TRAINED
        return cls(evaluates, checkpoints, syncs, lag, captures, releases_after)


class StepOrder:
    """The trainer order and the commit order of one run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, resumed_from: int):
        self.cfg = cfg
        self._released = self._committed = self._synced = resumed_from
        self._first, self._first_trains = resumed_from + 1, False
        self._released_at = self._last_step_end = time.perf_counter()
        self._closed: BaseException | None = None
        self._cond = threading.Condition()

    def __enter__(self) -> StepOrder:
        return self

    def schedule(self, step: int) -> StepSchedule:
        return StepSchedule.of(self.cfg, step)

    def passed(self, step: int, phase: Phase) -> None:
        """Step ``step``'s flow passed ``phase``: the trainer is released where its schedule
        says so."""
        if self.schedule(step).releases_after is phase:
            self.release(step)

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- start

    def wait_start_turn(self, step: int, timeout_s: float) -> None:
        """Block the creation of step ``step``'s flow run until the first step's flow trains. A
        flow run's creation costs the run process 0.1-0.3 s of CPU and calls to the Prefect API;
        created at once, the first steps' flows began the first step's last of four (0.63 s
        after the steps began against 0.13-0.32 s alone), on the cores that generate the first
        batch. Later flows are created as earlier steps commit, steps ahead of the trainer."""
        if step > self._first:
            self._wait(
                lambda: self._first_trains,
                timeout_s,
                f"step {step}'s flow run waited for step {self._first}'s flow to train",
            )

    def trains(self, step: int) -> None:
        """Step ``step`` has its batch and the trainer: after the first step, the others' flow
        runs may be created."""
        with self._cond:
            self._first_trains = self._first_trains or step == self._first
            self._cond.notify_all()

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

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: done() or self._closed is not None, timeout_s)
            if self._closed is not None:
                raise TrainingFinished(f"run closed: {what}") from self._closed
            if not ok:
                raise TimeoutError(f"{what} for {timeout_s:.0f}s")
