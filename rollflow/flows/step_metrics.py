"""One step's metrics row, filled by the step flow as it runs.

Owns: the row's keys. The row is stored as ``metrics/step=N.parquet`` and read by the progress
line, ``rollflow status``, the metric sinks and the step's table in the Prefect UI.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rollflow.tasks.advantage.task import Batch
from rollflow.tasks.generate.task import Evaluation, Rollouts
from rollflow.tasks.sync.task import Synced

# The producer's numbers a step records (the generate task returns more than these).
PRODUCER_KEYS = (
    "staleness_mean",
    "staleness_max",
    "stale_dropped_total",
    "groups_in_flight",
    "producer_blocked_s",
    "loop_lag_p50_s",
    "loop_lag_p99_s",
    "loop_lag_max_s",
    "retries_total",
    "inference_restarts",
    "resampled",
    "resampled_total",
)


class StepMetrics:
    """A step's metrics row: ``timed`` phases and ``record_*`` of each stage's result."""

    def __init__(self) -> None:
        self.row: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._ended: dict[str, float] = {}  # perf_counter at the end of each timed phase

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the wall clock of the block as ``key`` (seconds)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._ended[key] = time.perf_counter()
            self.row[key] = self._ended[key] - start

    def record_rollouts(self, r: Rollouts) -> None:
        self.row.update(
            {
                "reward_mean": r.reward_mean,
                **{f"reward/{env}": v for env, v in r.reward_by_env.items()},
                "num_rollouts": r.num_rollouts,
                "num_errors": r.num_errors,
                "rollouts_reused": r.reused,
                "num_skipped_rows": r.num_skipped_rows,
                **r.turns,
            }
        )
        self.row.update(
            {
                k: v
                for k, v in r.producer.items()
                if k in PRODUCER_KEYS or k.startswith("inference/")  # per server, when several
            }
        )

    def record_batch(self, b: Batch) -> None:
        self.row.update(
            num_groups_kept=b.num_groups_kept,
            num_samples_kept=b.num_samples_kept,
            num_failed_samples=b.num_failed_samples,
            num_truncated_samples=b.num_truncated,
        )

    def record_trainer_wait(self, trainer_free_at: float) -> None:
        """The trainer waited for data from when it was free (the previous step released it)
        until this step's batch was ready (the end of the advantage phase)."""
        self.row["trainer_wait_for_data_s"] = max(
            0.0, self._ended["advantage_phase_s"] - trainer_free_at
        )

    def record_train(self, metrics: dict[str, float]) -> None:
        self.row.update({k: v for k, v in metrics.items() if not isinstance(v, dict)})

    def record_sync(self, s: Synced | None) -> None:
        self.row.update(sync_s=s.total_s if s else None, sync_pause_s=s.pause_s if s else None)

    def record_eval(self, e: Evaluation) -> None:
        self.row["eval_reward"] = e.reward
        self.row.update({f"eval_reward/{env}": v for env, v in e.reward_by_env.items()})

    def record_end(self, step_s: float) -> dict[str, Any]:
        """Close the row: the flow's own time, and the step's share of the run's wall clock."""
        self.row["flow_s"] = time.perf_counter() - self._start
        self.row["step_s"] = step_s
        return self.row
