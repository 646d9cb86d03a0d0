"""The names of a step's metrics row: one owner for every stage that fills it and every reader.

The generate stage's producer names its numbers with these, the step flow (``flows/step_metrics``)
writes the row with them, and ``rollflow status``, the UI artifacts and the run flow's progress
line read them. A name is a plain string (Parquet columns, sinks), so readers of older runs and
notebooks see the same keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class Metric:
    """The names of a step's metrics row (a per-environment one is ``f"{name}/{env}"``)."""

    STEP = "step"  # added by storage.write_metrics
    # generate
    REWARD_MEAN = "reward_mean"
    REWARD = "reward"  # per environment: reward/<env>
    REWARD_FN = "reward_fn"  # per env and plain reward function: reward_fn/<env>/<function>
    NUM_ROLLOUTS = "num_rollouts"  # also per environment: num_rollouts/<env>
    # the model's tokens (mask 1) per rollout without error: mean and max over the step's
    COMPLETION_TOKENS_MEAN = "completion_tokens_mean"
    COMPLETION_TOKENS_MAX = "completion_tokens_max"
    NUM_ERRORS = "num_errors"
    ROLLOUTS_REUSED = "rollouts_reused"
    NUM_SKIPPED_ROWS = "num_skipped_rows"
    # the rollout producer's (tasks/generate/producer.py, host.py)
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
    TRAINER_RESTARTS = "trainer_restarts"  # the run's restarts of a lost trainer so far
    RESAMPLED = "resampled"
    RESAMPLED_TOTAL = "resampled_total"
    OVER_REQUESTED = "over_requested"  # groups admitted ahead for the replacements a step needs
    # quarantine of failing environments (tasks/generate/quarantine.py)
    ENVS_QUARANTINED = "envs_quarantined"  # envs whose prompts are set aside now
    ENV_QUARANTINED = "env_quarantined"  # per environment: env_quarantined/<env>, 0 or 1
    QUARANTINES_TOTAL = "quarantines_total"
    QUARANTINE_SET_ASIDE_TOTAL = "quarantine_set_aside_total"  # prompts not admitted
    QUARANTINE_PROBES_TOTAL = "quarantine_probes_total"
    INFERENCE_SERVERS = "inference_servers"  # servers serving (the fleet) when the step took
    INFERENCE = "inference"  # per server slot, when several: inference/<i>/...
    # advantage
    NUM_GROUPS_KEPT = "num_groups_kept"
    NUM_SAMPLES_KEPT = "num_samples_kept"
    NUM_FAILED_SAMPLES = "num_failed_samples"
    NUM_TRUNCATED_SAMPLES = "num_truncated_samples"
    # train (the trainer's own numbers keep the names it gives them; these are shown)
    LOSS = "loss"
    KL = "kl"  # to the reference policy (0 without one)
    MISMATCH_KL = "mismatch_kl"  # of the trainer's log-probabilities to vLLM's
    ENTROPY = "entropy"
    GRAD_NORM = "grad_norm"
    # sync and evaluation
    SYNC_S = "sync_s"
    SYNC_PAUSE_S = "sync_pause_s"
    SYNC_BYTES = "sync_bytes"  # what one weight sync carried (in the serving dtype)
    # the tries the slowest server's prefix-cache reset took after the sync (1: at once; one
    # refused to the deadline fails the sync): vLLM's KV of the old weights is never read again
    SYNC_CACHE_RESET_TRIES = "sync_cache_reset_tries"
    EVAL_REWARD = "eval_reward"  # per environment: eval_reward/<env>
    # eval_pass_at_<k> (k = 1..sampling.eval_samples, when above 1): eval_pass_at(k); per env too
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


def eval_pass_at(k: int) -> str:
    """The key of held-out pass@k (``eval_pass_at_4``), logged when ``sampling.eval_samples`` > 1."""
    return f"eval_pass_at_{k}"


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
