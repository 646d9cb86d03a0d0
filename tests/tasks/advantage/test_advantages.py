import pytest

from rollflow.infra.schema import rows_to_table
from rollflow.tasks.advantage.advantages import build_batch, grpo_advantages


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


def test_truncated_samples_kept_dropped_or_penalised():
    from rollflow.tasks.advantage.advantages import Overlong

    kept, stats = build_batch(_truncation_rows(), grpo_advantages)
    assert kept.num_rows == 3 and stats.num_truncated == 1
    dropped, _ = build_batch(_truncation_rows(), grpo_advantages, overlong=Overlong("drop"))
    # Out of the batch and out of the baseline: the group's mean is over the other two.
    assert dropped.column("sample_index").to_pylist() == [0, 2]
    assert dropped.column("advantage").to_pylist() == [0.5, -0.5]
    # DAPO's soft punishment with L_max = 4, buffer 2: 2 model tokens -> 0, 4 -> the whole
    # penalty (environment tokens do not count), truncated -> the whole penalty.
    rule = Overlong("penalize", max_tokens=4, buffer_tokens=2, penalty=0.5)
    penalised, _ = build_batch(_truncation_rows(), grpo_advantages, overlong=rule)
    assert penalised.column("reward").to_pylist() == [1.0, 0.5, -0.5]
    assert rule.reward_penalty({"completion_ids": [1, 2, 3], "truncated": False}) == -0.25
