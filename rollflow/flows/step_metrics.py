"""One step's metrics row, filled by the step flow as it runs.

Owns: the row's keys (``Metric``). The row is stored as ``metrics/step=N.parquet`` and read by
the progress line, ``rollflow status``, the metric sinks and the step's table in the Prefect UI,
each through these names. This module imports no stage at run time, so that ``rollflow status``
stays light.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflow.tasks.advantage.task import Batch
    from rollflow.tasks.generate.task import Evaluation, Rollouts
    from rollflow.tasks.sync.task import Synced


class Metric:
    """The names of a step's metrics row (a per-environment one is ``f"{name}/{env}"``)."""

    STEP = "step"  # added by storage.write_metrics
    # generate
    REWARD_MEAN = "reward_mean"
    REWARD = "reward"  # per environment: reward/<env>
    NUM_ROLLOUTS = "num_rollouts"
    NUM_ERRORS = "num_errors"
    ROLLOUTS_REUSED = "rollouts_reused"
    NUM_SKIPPED_ROWS = "num_skipped_rows"
    # the producer's numbers (named by tasks/generate/producer.py, which may not import flows)
    STALENESS_MEAN = "staleness_mean"
    STALENESS_MAX = "staleness_max"
    STALE_DROPPED_TOTAL = "stale_dropped_total"
    GROUPS_IN_FLIGHT = "groups_in_flight"
    PRODUCER_BLOCKED_S = "producer_blocked_s"
    LOOP_LAG_P50_S = "loop_lag_p50_s"
    LOOP_LAG_P99_S = "loop_lag_p99_s"
    LOOP_LAG_MAX_S = "loop_lag_max_s"
    RETRIES_TOTAL = "retries_total"
    INFERENCE_RESTARTS = "inference_restarts"
    RESAMPLED = "resampled"
    RESAMPLED_TOTAL = "resampled_total"
    INFERENCE = "inference"  # per server, when several: inference/<i>/...
    # advantage
    NUM_GROUPS_KEPT = "num_groups_kept"
    NUM_SAMPLES_KEPT = "num_samples_kept"
    NUM_FAILED_SAMPLES = "num_failed_samples"
    NUM_TRUNCATED_SAMPLES = "num_truncated_samples"
    # train (the trainer's own numbers keep the names it gives them; this one is shown)
    LOSS = "loss"
    # sync and evaluation
    SYNC_S = "sync_s"
    SYNC_PAUSE_S = "sync_pause_s"
    EVAL_REWARD = "eval_reward"  # per environment: eval_reward/<env>
    # timed phases of the step flow
    GENERATE_PHASE_S = "generate_phase_s"
    ADVANTAGE_PHASE_S = "advantage_phase_s"
    WAIT_FOR_PREVIOUS_STEP_S = "wait_for_previous_step_s"
    TRAINER_WAIT_FOR_DATA_S = "trainer_wait_for_data_s"
    TRAIN_PHASE_S = "train_phase_s"
    CAPTURE_S = "capture_s"
    SYNC_PHASE_S = "sync_phase_s"
    EVAL_PHASE_S = "eval_phase_s"
    FLOW_S = "flow_s"
    STEP_S = "step_s"


# The producer's numbers a step records (the generate task returns more than these).
PRODUCER_KEYS = (
    Metric.STALENESS_MEAN,
    Metric.STALENESS_MAX,
    Metric.STALE_DROPPED_TOTAL,
    Metric.GROUPS_IN_FLIGHT,
    Metric.PRODUCER_BLOCKED_S,
    Metric.LOOP_LAG_P50_S,
    Metric.LOOP_LAG_P99_S,
    Metric.LOOP_LAG_MAX_S,
    Metric.RETRIES_TOTAL,
    Metric.INFERENCE_RESTARTS,
    Metric.RESAMPLED,
    Metric.RESAMPLED_TOTAL,
)


def per_env(name: str, env: str) -> str:
    """The key of ``name`` for one environment (``reward/<env>``)."""
    return f"{name}/{env}"


def by_env(row: dict[str, Any], name: str) -> dict[str, Any]:
    """The per-environment values of ``name`` in a row: {env: value}."""
    prefix = f"{name}/"
    return {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}


def is_number(value: Any) -> bool:
    """A number that is not NaN (a row written before a metric existed holds NaN or nothing)."""
    return isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value))


def series(rows: Iterable[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """(step, value) of every row where ``name`` is a number, e.g. the held-out rewards."""
    return [(r[Metric.STEP], r[name]) for r in rows if is_number(r.get(name))]


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
                Metric.REWARD_MEAN: r.reward_mean,
                **{per_env(Metric.REWARD, env): v for env, v in r.reward_by_env.items()},
                Metric.NUM_ROLLOUTS: r.num_rollouts,
                Metric.NUM_ERRORS: r.num_errors,
                Metric.ROLLOUTS_REUSED: r.reused,
                Metric.NUM_SKIPPED_ROWS: r.num_skipped_rows,
                **r.turns,
            }
        )
        self.row.update(
            {
                k: v
                for k, v in r.producer.items()
                if k in PRODUCER_KEYS
                or k.startswith(f"{Metric.INFERENCE}/")  # per server, when several
            }
        )

    def record_batch(self, b: Batch) -> None:
        self.row.update(
            {
                Metric.NUM_GROUPS_KEPT: b.num_groups_kept,
                Metric.NUM_SAMPLES_KEPT: b.num_samples_kept,
                Metric.NUM_FAILED_SAMPLES: b.num_failed_samples,
                Metric.NUM_TRUNCATED_SAMPLES: b.num_truncated,
            }
        )

    def record_trainer_wait(self, trainer_free_at: float) -> None:
        """The trainer waited for data from when it was free (the previous step released it)
        until this step's batch was ready (the end of the advantage phase)."""
        self.row[Metric.TRAINER_WAIT_FOR_DATA_S] = max(
            0.0, self._ended[Metric.ADVANTAGE_PHASE_S] - trainer_free_at
        )

    def record_train(self, metrics: dict[str, float]) -> None:
        self.row.update({k: v for k, v in metrics.items() if not isinstance(v, dict)})

    def record_sync(self, s: Synced | None) -> None:
        self.row[Metric.SYNC_S] = s.total_s if s else None
        self.row[Metric.SYNC_PAUSE_S] = s.pause_s if s else None

    def record_eval(self, e: Evaluation) -> None:
        self.row[Metric.EVAL_REWARD] = e.reward
        self.row.update({per_env(Metric.EVAL_REWARD, env): v for env, v in e.reward_by_env.items()})

    def record_end(self, step_s: float) -> dict[str, Any]:
        """Close the row: the flow's own time, and the step's share of the run's wall clock."""
        self.row[Metric.FLOW_S] = time.perf_counter() - self._start
        self.row[Metric.STEP_S] = step_s
        return self.row
