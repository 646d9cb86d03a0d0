"""A step's metrics row is written and read through the names of ``Metric`` (step_metrics.py)."""

import math
from types import SimpleNamespace

from rollflow.flows.step_metrics import StepMetrics
from rollflow.infra.metric_names import Metric, by_env, eval_pass_at, per_env, series
from rollflow.tasks.generate.evaluation import Evaluation


def test_eval_is_recorded_overall_and_per_environment():
    m = StepMetrics()
    m.record_eval(Evaluation(reward=0.5, reward_by_env={"add": 0.25, "sort": 0.75}))
    assert m.row[Metric.EVAL_REWARD] == 0.5
    assert m.row[per_env(Metric.EVAL_REWARD, "add")] == 0.25
    assert by_env(m.row, Metric.EVAL_REWARD) == {"add": 0.25, "sort": 0.75}
    assert not any(key.startswith("eval_pass") for key in m.row)  # one sample: no pass@k


def test_eval_of_k_samples_records_pass_at_1_to_k():
    m = StepMetrics()
    m.record_eval(
        Evaluation(
            reward=0.5,
            reward_by_env={"add": 0.5},
            samples=2,
            pass_at_k={1: 0.5, 2: 0.75},
            pass_at_k_by_env={"add": {1: 0.5, 2: 0.75}},
        )
    )
    assert m.row[eval_pass_at(1)] == 0.5 and m.row[eval_pass_at(2)] == 0.75
    assert m.row[per_env(eval_pass_at(2), "add")] == 0.75
    assert eval_pass_at(2) == "eval_pass_at_2"  # a name every metrics sink takes


def test_series_skips_rows_without_a_number():
    rows = [
        {Metric.STEP: 0, Metric.EVAL_REWARD: 0.1},
        {Metric.STEP: 1},
        {Metric.STEP: 2, Metric.EVAL_REWARD: math.nan},
        {Metric.STEP: 3, Metric.EVAL_REWARD: 0.4},
    ]
    assert series(rows, Metric.EVAL_REWARD) == [(0, 0.1), (3, 0.4)]


def test_timed_phases_and_the_end_use_the_names():
    m = StepMetrics()
    with m.timed(Metric.ADVANTAGE_PHASE_S):
        pass
    m.record_trainer_wait(trainer_free_at=0.0)
    row = m.record_end(step_s=1.5)
    assert row[Metric.STEP_S] == 1.5 and row[Metric.FLOW_S] >= 0
    assert row[Metric.TRAINER_WAIT_FOR_DATA_S] >= 0 and Metric.ADVANTAGE_PHASE_S in row


def test_the_producers_quarantine_numbers_reach_the_row():
    producer = {
        Metric.ENVS_QUARANTINED: 1,
        per_env(Metric.ENV_QUARANTINED, "calc"): 1,
        per_env(Metric.ENV_QUARANTINED, "add"): 0,
        Metric.QUARANTINES_TOTAL: 2,
        Metric.QUARANTINE_SET_ASIDE_TOTAL: 40,
        Metric.QUARANTINE_PROBES_TOTAL: 3,
        "num_admitted": 99,  # the producer's own bookkeeping stays out of the row
    }
    m = StepMetrics()
    m.record_rollouts(
        SimpleNamespace(
            reward_mean=0.5,
            reward_by_env={},
            num_rollouts=8,
            rollouts_by_env={"add": 8},
            completion_tokens_mean=3.5,
            completion_tokens_max=6,
            num_errors=0,
            reused=False,
            num_skipped_rows=0,
            turns={},
            producer=producer,
            reward_fns={},
        )
    )
    assert by_env(m.row, Metric.ENV_QUARANTINED) == {"calc": 1, "add": 0}
    assert m.row[Metric.QUARANTINE_SET_ASIDE_TOTAL] == 40 and m.row[Metric.ENVS_QUARANTINED] == 1
    assert "num_admitted" not in m.row
    assert m.row[per_env(Metric.NUM_ROLLOUTS, "add")] == 8
    assert m.row[Metric.COMPLETION_TOKENS_MEAN] == 3.5 and m.row[Metric.COMPLETION_TOKENS_MAX] == 6


def test_the_progress_line_says_how_many_groups_dynamic_sampling_replaced_and_over_requested():
    from rollflow.flows.rl_run import progress_line

    row = {
        Metric.REWARD_MEAN: 0.5,
        Metric.NUM_GROUPS_KEPT: 8,
        Metric.LOSS: 0.01,
        Metric.TRAINER_WAIT_FOR_DATA_S: 0.1,
        Metric.TRAIN_PHASE_S: 0.2,
        Metric.SYNC_PHASE_S: 0.1,
        Metric.STEP_S: 0.5,
    }
    assert "kept 8 groups (3 resampled), loss" in progress_line(2, 4, {**row, Metric.RESAMPLED: 3})
    # None replaced, or a step that reused its committed rollouts: nothing said.
    for value in (0, math.nan):
        assert "kept 8 groups, loss" in progress_line(2, 4, {**row, Metric.RESAMPLED: value})
    assert "kept 8 groups, loss" in progress_line(2, 4, row)
    # Dynamic sampling's over-request (groups admitted in the step's first wave ahead of the
    # replacements): said beside the replacements, or alone.
    both = {**row, Metric.RESAMPLED: 3, Metric.OVER_REQUESTED: 4}
    assert "kept 8 groups (3 resampled, 4 over-requested), loss" in progress_line(2, 4, both)
    alone = {**row, Metric.OVER_REQUESTED: 4}
    assert "kept 8 groups (4 over-requested), loss" in progress_line(2, 4, alone)
