import random

import torch

from rollflow.tasks.train.trainer import Trainer


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        p = [1] + [rng.randint(4, 40) for _ in range(rng.randint(2, 6))]
        c = [rng.randint(4, 40) for _ in range(rng.randint(1, 5))] + [2]
        rows.append({"prompt_ids": p, "completion_ids": c,
                     "completion_logprobs": [rng.uniform(-4, -1) for _ in c], "advantage": rng.uniform(-1, 1)})
    return rows


def _grads(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def _trainer(model_dir, micro_batch_tokens: int) -> Trainer:
    return Trainer(model_dir, lr=1e-3, weight_decay=0.0, max_grad_norm=1e9, micro_batch_tokens=micro_batch_tokens)


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_dir):
    rows = _rows(12)
    total = sum(len(r["completion_ids"]) for r in rows)
    big, small = _trainer(tiny_model_dir, 10_000), _trainer(tiny_model_dir, 24)
    assert len(list(small._micro_batches(rows))) > 3
    out_big = big.forward_backward(rows, total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    out_small = small.forward_backward(rows, total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    assert abs(out_big["loss"] - out_small["loss"]) < 1e-6
    assert torch.allclose(_grads(big), _grads(small), atol=1e-7)


def test_split_calls_equal_one_call(tiny_model_dir):
    rows = _rows(8, seed=1)
    total = sum(len(r["completion_ids"]) for r in rows)
    one, two = _trainer(tiny_model_dir, 10_000), _trainer(tiny_model_dir, 10_000)
    one.forward_backward(rows, total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    two.forward_backward(rows[:3], total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    two.forward_backward(rows[3:], total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    assert torch.allclose(_grads(one), _grads(two), atol=1e-7)


def test_checkpoint_round_trip_continues_identically(tiny_model_dir, tmp_path):
    rows = _rows(6, seed=2)
    total = sum(len(r["completion_ids"]) for r in rows)
    a = _trainer(tiny_model_dir, 10_000)
    a.forward_backward(rows, total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
    a.optim_step()
    a.save_checkpoint(tmp_path / "ckpt")
    b = _trainer(tmp_path / "ckpt", 10_000)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 1
    for trainer in (a, b):
        trainer.forward_backward(rows, total_loss_tokens=total, eps_low=0.2, eps_high=0.2)
        trainer.optim_step()
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_optim_step_without_gradients_is_an_error(tiny_model_dir):
    import pytest

    with pytest.raises(RuntimeError, match="no gradients"):
        _trainer(tiny_model_dir, 100).optim_step()
