"""What training a real model needs, in one rank (a 1-rank gloo group, FSDP2): activation
checkpointing, a decaying learning rate that a checkpoint keeps, model.revision and
model.trust_remote_code reaching the loaders."""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.infra.config import LossConfig, TrainerServiceSection, TrainSection
from rollflow.trainer import policy as policy_module
from rollflow.trainer.backends import lr_factor
from rollflow.trainer.packing import pack, plan_micro_batches
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

from trainer_support import make_rows, max_abs, max_abs_diff, one_process_group, sequences

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    yield from one_process_group(tmp_path_factory)


def _micro_batches(rows):
    seqs = sequences(rows)
    plan = plan_micro_batches([s.num_tokens for s in seqs], 1, 10_000)
    return [pack([seqs[i] for i in mb], 32) for mb in plan[0]]


def _tokens(rows):
    return sum(len(r["completion_ids"]) for r in rows)


# ------------------------------------------------------------------ activation checkpointing


def _saved_bytes_and_grads(model_dir, checkpointing: bool, rows):
    spec = TrainerSpec(
        model_path=str(model_dir),
        train=TrainSection(lr=1e-3),
        trainer=TrainerServiceSection(activation_checkpointing=checkpointing),
    )
    trainer = Trainer(spec, CPU)
    saved = [0]

    def pack_hook(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        trainer.forward_backward(_micro_batches(rows), LossConfig(), _tokens(rows))
    return saved[0], trainer.full_gradients()


def test_activation_checkpointing_keeps_less_for_backward_and_the_same_gradients(
    tiny_model_dir,
):
    """Under FSDP2's per-layer fully_shard: the layers' activations are recomputed in backward
    (what the forward keeps for backward shrinks), and the gradients do not change."""
    rows = make_rows(12, seed=11)
    kept_plain, grads_plain = _saved_bytes_and_grads(tiny_model_dir, False, rows)
    kept_ckpt, grads_ckpt = _saved_bytes_and_grads(tiny_model_dir, True, rows)
    assert kept_ckpt < 0.6 * kept_plain, (kept_ckpt, kept_plain)
    assert max_abs_diff(grads_ckpt, grads_plain) < 1e-6 * max(1.0, max_abs(grads_plain))


# ------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.1]),
        ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55, 0.1]),
    ],
)
def test_each_schedule_warms_up_then_decays_to_its_floor(schedule, expected):
    # 2 warm-up steps, decay over steps 2..10, floor 0.1; steps 0, 1, 2, 4, 6, 10 (and past it).
    shape = {"warmup_steps": 2, "schedule": schedule, "total_steps": 10, "min_lr_ratio": 0.1}
    got = [lr_factor(step, **shape) for step in (0, 1, 2, 4, 6, 10)]
    assert got == pytest.approx(expected)
    assert lr_factor(25, **shape) == pytest.approx(expected[-1])


def test_the_decay_spans_the_runs_optimizer_steps_and_survives_a_checkpoint(
    tiny_model_dir, tmp_path
):
    # 3 outer steps x 2 optimizer steps = 6: warm-up 1, then linear to 0.2 at step 6.
    train = TrainSection(
        lr=1e-3,
        train_batch_size=2,
        mini_batch_size=1,
        lr_warmup_steps=1,
        lr_schedule="linear",
        min_lr_ratio=0.2,
    )
    rows = make_rows(4, seed=12)

    def make(path):
        return Trainer(TrainerSpec(model_path=str(path), train=train, num_steps=3), CPU)

    def step(trainer):
        trainer.forward_backward(_micro_batches(rows), LossConfig(), _tokens(rows))
        return trainer.optim_step()["lr"]

    def expected(k):
        return 1e-3 * (0.2 + 0.8 * (1 - (k - 1) / 5)) if k else 1e-3

    a = make(tiny_model_dir)
    assert [step(a) for _ in range(3)] == pytest.approx([expected(k) for k in range(3)])
    a.save_checkpoint(tmp_path / "ckpt")
    b = make(tmp_path / "ckpt")
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.backend.current_lr() == pytest.approx(expected(3))
    assert step(b) == pytest.approx(step(a)) == pytest.approx(expected(3))
    assert expected(3) < 1e-3


# ------------------------------------------------------------- revision, trust_remote_code


def test_revision_and_trust_remote_code_reach_the_trainers_loaders(tiny_model_dir, monkeypatch):
    seen = []
    for cls in (policy_module.AutoConfig, policy_module.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def spy(klass, path, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("revision"), kwargs.get("trust_remote_code")))
            return _original(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    spec = TrainerSpec(
        model_path=str(tiny_model_dir),
        reference_model_path=str(tiny_model_dir),
        revision="v1.0",
        trust_remote_code=True,
    )
    Trainer(spec, CPU)
    assert len(seen) == 4  # config and weights, of the policy and of the KL reference
    assert {(rev, trust) for _, rev, trust in seen} == {("v1.0", True)}
