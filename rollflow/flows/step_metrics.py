"""One step's metrics row, filled by the step flow as it runs.

The row's keys are ``Metric``'s names (``infra/metric_names.py``). The row is stored as
``metrics/step=N.parquet`` and read by the progress line, ``rollflow status``, the metric sinks
and the step's table in the Prefect UI, each through these names. This module imports the stages
only for type checking.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rollflow.infra.metric_names import Metric, eval_pass_at, per_env

if TYPE_CHECKING:
    from rollflow.tasks.advantage.advantage_task import Batch
    from rollflow.tasks.generate.evaluation import Evaluation
    from rollflow.tasks.generate.generate_task import Rollouts
    from rollflow.tasks.sync.sync_task import Synced


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
    Metric.INFERENCE_SERVERS,
    Metric.RESAMPLED,
    Metric.RESAMPLED_TOTAL,
    Metric.OVER_REQUESTED,
    Metric.ENVS_QUARANTINED,
    Metric.QUARANTINES_TOTAL,
    Metric.QUARANTINE_SET_ASIDE_TOTAL,
    Metric.QUARANTINE_PROBES_TOTAL,
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
                Metric.REWARD_MEAN: r.reward_mean,
                **{per_env(Metric.REWARD, env): v for env, v in r.reward_by_env.items()},
                **{per_env(Metric.REWARD_FN, key): v for key, v in r.reward_fns.items()},
                Metric.NUM_ROLLOUTS: r.num_rollouts,
                **{per_env(Metric.NUM_ROLLOUTS, env): n for env, n in r.rollouts_by_env.items()},
                Metric.COMPLETION_TOKENS_MEAN: r.completion_tokens_mean,
                Metric.COMPLETION_TOKENS_MAX: r.completion_tokens_max,
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
                or k.startswith(f"{Metric.ENV_QUARANTINED}/")  # per environment
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
        self.row[Metric.SYNC_BYTES] = s.bytes if s else None
        self.row[Metric.SYNC_CACHE_RESET_TRIES] = s.cache_reset_tries if s else None

    def record_eval(self, e: Evaluation) -> None:
        self.row[Metric.EVAL_REWARD] = e.reward
        self.row.update({per_env(Metric.EVAL_REWARD, env): v for env, v in e.reward_by_env.items()})
        if e.samples > 1:  # pass@1..k of k samples per prompt (sampling.eval_samples)
            for k, v in e.pass_at_k.items():
                self.row[eval_pass_at(k)] = v
            for env, by_k in e.pass_at_k_by_env.items():
                self.row.update({per_env(eval_pass_at(k), env): v for k, v in by_k.items()})

    def record_trainer_restarts(self, restarts: int) -> None:
        self.row[Metric.TRAINER_RESTARTS] = restarts

    def record_end(self, step_s: float) -> dict[str, Any]:
        """Close the row: the flow's own time, and the step's share of the run's wall clock."""
        self.row[Metric.FLOW_S] = time.perf_counter() - self._start
        self.row[Metric.STEP_S] = step_s
        return self.row
