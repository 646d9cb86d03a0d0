import random

import pytest
import torch

from rollflow.trainer.packing import micro_batches, pack, plan_micro_batches, split_across_ranks
from rollflow.trainer.policy import PackedPolicy, load_hf_model

from trainer_support import load, make_rows, sequences, token_logprobs


def _lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, 60) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_every_sequence_goes_to_exactly_one_rank_balanced_by_tokens(world):
    lengths = _lengths(50, seed=world)
    shares = split_across_ranks(lengths, world)
    assert sorted(i for share in shares for i in share) == list(range(50))
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths)


def test_micro_batches_respect_the_budget_and_never_split_a_sequence():
    lengths = [10, 30, 5, 70, 20, 20, 1]
    batches = micro_batches(list(range(7)), lengths, budget=40)
    assert [i for b in batches for i in b] == list(range(7))
    for b in batches:
        assert sum(lengths[i] for i in b) <= 40 or len(b) == 1  # 70 alone exceeds it
    assert [70] in [[lengths[i] for i in b] for b in batches]


@pytest.mark.parametrize(("n", "world"), [(13, 2), (3, 4), (1, 2)])
def test_every_rank_gets_the_same_number_of_micro_batches(n, world):
    lengths = _lengths(n, seed=n)
    plan = plan_micro_batches(lengths, world, budget=50)
    assert len({len(p) for p in plan}) == 1
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(n))
    if n < world:
        assert any(
            mb == [] for p in plan for mb in p
        )  # a rank with nothing runs an empty micro-batch


def test_pack_restarts_positions_and_points_each_target_at_its_predictor():
    rows = make_rows(9, seed=3)
    mb = pack(sequences(rows), row_tokens=24)
    ids_flat = mb.input_ids_R_P.reshape(-1)
    pos_flat = mb.position_ids_R_P.reshape(-1)
    assert torch.equal(ids_flat[mb.hidden_index_N + 1], mb.targets_N)
    assert mb.num_tokens == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    # Each loss token's predictor is inside its own sequence: its position is >= the prompt's last.
    assert int((pos_flat[mb.hidden_index_N] >= 0).all())
    assert int((mb.position_ids_R_P[:, 0] == 0).all())
    # The [B, T] layout holds each row's completion in order.
    targets_B_T = mb.to_B_T(mb.targets_N.float())
    for b, seq in enumerate(mb.sequences):
        assert targets_B_T[b, : len(seq.completion_ids)].tolist() == [
            float(t) for t in seq.completion_ids
        ]


def test_empty_micro_batch_is_a_dummy_with_no_loss_tokens():
    mb = pack([], row_tokens=64)
    assert mb.is_empty and mb.num_tokens == 0 and mb.input_ids_R_P.shape == (1, 2)


@pytest.mark.parametrize("row_tokens", [None, 16, 40])
def test_packed_rows_attend_within_each_sequence_only(tiny_model_dir, row_tokens):
    """Packed forward (HF reads restarting position_ids as separate sequences) == each sequence alone."""
    rows = make_rows(10, seed=5)
    mb = pack(sequences(rows), row_tokens)
    policy = PackedPolicy(load_hf_model(tiny_model_dir, torch.device("cpu")))
    with torch.no_grad():
        logp_N, _ = policy(mb.input_ids_R_P, mb.position_ids_R_P, mb.hidden_index_N, mb.targets_N)
        logp_B_T = mb.to_B_T(logp_N)
        plain = load(tiny_model_dir)
        for b, seq in enumerate(mb.sequences):
            row = next(r for r in rows if (r["group_index"], r["sample_index"]) == seq.key)
            expected, _ = token_logprobs(plain, row)
            assert torch.allclose(logp_B_T[b, : len(expected)], expected, atol=1e-5), (
                row_tokens,
                b,
            )


def test_the_loss_mask_packs_with_its_tokens_and_bad_masks_are_named():
    from rollflow.infra.errors import InputError
    from rollflow.trainer.batches import check_row

    rows = make_rows(12, seed=3, masked=True)
    seqs = sequences(rows)
    for seq, row in zip(seqs, rows, strict=True):
        seq.loss_mask = row.get("completion_mask")
    mb = pack(seqs, row_tokens=32)
    # Rows are packed longest first; in the loss's [B, T] layout each sequence's mask is its own.
    mask_B_T = mb.mask_B_T()
    for b, row in enumerate(rows):
        want = row.get("completion_mask") or [1] * len(row["completion_ids"])
        assert mask_B_T[b, : len(want)].tolist() == want
        assert mask_B_T[b, len(want) :].sum() == 0
    assert sum(0 in (r.get("completion_mask") or []) for r in rows) >= 2
    bad = {**rows[1], "completion_mask": [1, 0]}
    with pytest.raises(InputError, match="completion_mask must hold one 0 or 1 per completion"):
        check_row(3, 1, bad, None, False)
