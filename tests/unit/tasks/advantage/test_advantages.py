import math
import re

import pytest

from rollflow.infra.config import TrainSection
from rollflow.infra.errors import ConfigError
from rollflow.infra.schema import rows_to_table
from rollflow.tasks.advantage.advantages import (
    advantage_fn,
    build_batch,
    dr_grpo_advantages,
    grpo_advantages,
    pass_at_k_advantages,
    rloo_advantages,
)


def test_grpo_advantages():
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    norm = grpo_advantages([1.0, 0.0], normalize_std=True)
    assert norm[0] == pytest.approx(0.7071, abs=1e-3) and norm[0] == -norm[1]


def _rows(groups):
    rows = []
    for g, samples in enumerate(groups):
        for s, (reward, error) in enumerate(samples):
            rows.append(
                {
                    "run": "r",
                    "step": 1,
                    "env": "add",
                    "prompt_id": f"p{g}",
                    "group_index": g,
                    "sample_index": s,
                    "prompt_ids": [1],
                    "completion_ids": [5, 2],
                    "completion_logprobs": [-1.0, -1.0],
                    "reward": reward,
                    "error": error,
                }
            )
    return rows_to_table(rows)


def test_partial_groups_keep_survivors_and_zero_advantage_groups_drop():
    table = _rows(
        [
            [(1.0, None), (0.0, None), (None, "reward: ValueError: x")],  # partial: 2 survivors
            [(1.0, None), (1.0, None), (1.0, None)],  # all equal: no signal
            [
                (None, "rollout: RuntimeError: dead"),
                (None, "rollout: RuntimeError: dead"),
                (None, "rollout: x"),
            ],
        ]
    )
    batch, stats = build_batch(table, grpo_advantages)
    assert batch.column("group_index").to_pylist() == [0, 0]
    assert batch.column("advantage").to_pylist() == [0.5, -0.5]
    assert stats.num_failed_samples == 4 and stats.num_zero_advantage_groups == 1
    assert stats.failure_reasons == {"reward": 1, "rollout": 3}


def test_group_scored_env_drops_whole_group_on_failure():
    table = _rows([[(1.0, None), (0.0, None), (None, "reward: boom")]])
    batch, _ = build_batch(table, grpo_advantages, group_scored_envs={"add"})
    assert batch.num_rows == 0


def test_advantage_contract_is_checked():
    table = _rows([[(1.0, None), (0.0, None)]])
    with pytest.raises(ValueError, match="returned 1 values for a group of 2"):
        build_batch(table, lambda rewards: [0.0])


# ------------------------------------------------------------- estimators, by hand


def test_dr_grpo_centres_and_never_scales():
    assert dr_grpo_advantages([1.0, 0.0, 0.0, 0.0]) == [0.75, -0.25, -0.25, -0.25]
    assert dr_grpo_advantages([3.0, 1.0]) == [1.0, -1.0]  # GRPO with std would give ±0.707


def test_rloo_baseline_leaves_the_sample_out():
    # r = [1, 0, 0, 1]: baselines are the others' means 1/3, 2/3, 2/3, 1/3
    assert rloo_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo_advantages([2.0, 4.0, 9.0]) == pytest.approx([2 - 6.5, 4 - 5.5, 9 - 3.0])
    assert rloo_advantages([5.0]) == [0.0]


def test_pass_at_k_by_hand():
    # n = 4, one right, k = 2: R = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2;
    # right: (1 - 1/2)/(1/2) = 1; wrong: (1/2 - C(2,1)/C(3,1))/(1/2) = (1/2 - 2/3)*2 = -1/3
    assert pass_at_k_advantages([1, 0, 0, 0], k=2) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # k = 1 is GRPO with the population std: p = 1/4, sigma = sqrt(3)/4
    s = math.sqrt(3) / 4
    assert pass_at_k_advantages([1, 0, 0, 0], k=1) == pytest.approx(
        [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]
    )
    assert pass_at_k_advantages([1, 1, 1, 1], k=2) == [0.0] * 4
    assert sum(pass_at_k_advantages([1, 0, 1, 0, 0, 0], k=3)) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="rewards of 0 or 1"):
        pass_at_k_advantages([0.5, 1.0], k=1)


def _my_estimator(rewards, scale=1.0):
    return [scale * r for r in rewards]


def test_estimators_by_name_or_path_with_arguments():
    train = TrainSection(advantage="rloo")
    assert advantage_fn(train)([1.0, 0.0]) == [1.0, -1.0]
    train = TrainSection(normalize_std=True)  # grpo takes train.normalize_std
    assert advantage_fn(train)([1.0, 0.0])[0] == pytest.approx(0.7071, abs=1e-3)
    train = TrainSection(advantage="pass_at_k", advantage_args={"k": 2})
    assert advantage_fn(train)([1, 0, 0, 0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    path = f"{__name__}:_my_estimator"
    assert advantage_fn(TrainSection(advantage=path, advantage_args={"scale": 2}))([1.0]) == [2.0]


@pytest.mark.parametrize(
    ("advantage", "args", "message"),
    [
        ("gpro", {}, "train.advantage = 'gpro' is unknown: choose one of grpo, dr_grpo"),
        ("no_such_module:f", {}, "cannot load 'f' from module 'no_such_module'"),
        ("rloo", {"k": 2}, "train.advantage_args {'k': 2} do not fit 'rloo'"),
    ],
)
def test_a_bad_estimator_is_one_clear_line(advantage, args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        advantage_fn(TrainSection(advantage=advantage, advantage_args=args))


def _truncation_rows():
    """One group: a finished sample (reward 1, 2 model tokens), a truncated one (reward 1),
    and a finished one with 6 model tokens of which 2 are environment tokens (reward 0)."""
    table = _rows([[(1.0, None), (1.0, None), (0.0, None)]]).to_pylist()
    table[1]["truncated"] = True
    table[2].update(
        completion_ids=[5, 6, 7, 8, 9, 2],
        completion_logprobs=[-1.0] * 6,
        completion_mask=[1, 1, 0, 0, 1, 1],
    )
    return rows_to_table(table)


def test_truncated_samples_kept_dropped_masked_or_penalised():
    from rollflow.tasks.advantage.advantages import Overlong

    kept, stats = build_batch(_truncation_rows(), grpo_advantages)
    assert kept.num_rows == 3 and stats.num_truncated == 1
    dropped, _ = build_batch(_truncation_rows(), grpo_advantages, overlong=Overlong("drop"))
    # Out of the batch and out of the baseline: the group's mean is over the other two.
    assert dropped.column("sample_index").to_pylist() == [0, 2]
    assert dropped.column("advantage").to_pylist() == [0.5, -0.5]
    # Masked (TRL's mask_truncated_completions): out of the batch, in the baseline (mean 2/3).
    masked, _ = build_batch(_truncation_rows(), grpo_advantages, overlong=Overlong("mask"))
    assert masked.column("sample_index").to_pylist() == [0, 2]
    assert masked.column("advantage").to_pylist() == pytest.approx([1 / 3, -2 / 3])
    # DAPO's soft punishment with L_max = 4, buffer 2: 2 model tokens -> 0, 4 -> the whole
    # penalty (environment tokens do not count), truncated -> the whole penalty.
    rule = Overlong("penalize", max_tokens=4, buffer_tokens=2, penalty=0.5)
    penalised, _ = build_batch(_truncation_rows(), grpo_advantages, overlong=rule)
    assert penalised.column("reward").to_pylist() == [1.0, 0.5, -0.5]
    assert rule.reward_penalty({"completion_ids": [1, 2, 3], "truncated": False}) == -0.25


def test_a_batchs_loss_tokens_are_its_model_tokens():
    from rollflow.tasks.advantage.advantages import num_loss_tokens

    # 2 + 2 + 4 (6 tokens, 2 of them the environment's).
    assert num_loss_tokens(_truncation_rows()) == 8
    assert num_loss_tokens(_truncation_rows().drop_columns(["completion_mask"])) == 10


def test_a_batchs_loss_tokens_count_the_zero_advantage_groups_it_left_out(tmp_path):
    """The filter takes a group of equal rewards out of the batch, not its tokens out of the
    step's count (TRL's dapo denominator counts them), and the count survives the batch's
    Parquet: a resumed step divides by the same total."""
    from rollflow.infra.storage import RunStorage
    from rollflow.tasks.advantage.advantages import num_loss_tokens

    equal = _rows([[(1.0, None), (1.0, None)]]).to_pylist()  # 2 samples of 2 model tokens
    for row in equal:
        row.update(group_index=1, prompt_id="p1")
    table = rows_to_table(_truncation_rows().to_pylist() + equal)
    batch, stats = build_batch(table, grpo_advantages)
    assert stats.num_zero_advantage_groups == 1 and stats.num_zero_advantage_tokens == 4
    assert set(batch.column("group_index").to_pylist()) == {0}
    assert num_loss_tokens(batch) == 8 + 4
    unfiltered, _ = build_batch(table, grpo_advantages, filter_zero_advantage=False)
    assert unfiltered.num_rows == 5 and num_loss_tokens(unfiltered) == 12
    storage = RunStorage(str(tmp_path), "r")
    storage.write_step_table("batches", 3, batch)
    assert num_loss_tokens(storage.read_step_table("batches", 3)) == 12
