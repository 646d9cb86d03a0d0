"""One rank in this process (a 1-rank gloo group, FSDP2): the trainer's math against the reference.

Multi-rank runs of the same checks, through the real launchers, are in test_trainer_service.py.
"""

import pytest
import torch

from rollflow.infra.config import LossConfig, TrainerServiceSection, TrainSection
from rollflow.infra.weights.group import metadata_bytes
from rollflow.trainer.packing import pack, plan_micro_batches
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

from trainer_support import (
    adamw_step,
    load,
    make_rows,
    max_abs,
    max_abs_diff,
    one_process_group,
    reference,
    sequences,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    yield from one_process_group(tmp_path_factory)


def _trainer(model_dir, reference_model_path=None, **train) -> Trainer:
    train = TrainSection(**{"lr": 1e-3, "max_grad_norm": 1e9, **train})
    return Trainer(
        TrainerSpec(
            model_path=str(model_dir), train=train, reference_model_path=reference_model_path
        ),
        CPU,
    )


def _micro_batches(rows, budget, row_tokens=32):
    seqs = sequences(rows)
    plan = plan_micro_batches([s.num_tokens for s in seqs], 1, budget)
    return [pack([seqs[i] for i in mb], row_tokens) for mb in plan[0]]


def _tokens(rows):
    return sum(len(r["completion_ids"]) for r in rows)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(eps_low=0.1, eps_high=0.2, entropy_coef=0.01),
        LossConfig(kind="gspo", eps_low=0.02, eps_high=0.03),
    ],
    ids=["ppo", "gspo"],
)
def test_gradients_equal_the_single_sequence_reference(tiny_model_dir, cfg):
    rows = make_rows(12, seed=1)
    trainer = _trainer(tiny_model_dir)
    out = trainer.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    ref = reference(tiny_model_dir, rows, cfg)
    grads = trainer.full_gradients()
    assert max_abs_diff(grads, ref["grads"]) < 1e-6 * max(1.0, max_abs(ref["grads"]))
    assert out["sums"]["loss_sum"] / _tokens(rows) == pytest.approx(ref["loss"], abs=1e-6)


def test_micro_batch_accumulation_equals_one_big_batch(tiny_model_dir):
    rows = make_rows(16, seed=2)
    cfg = LossConfig()
    big, small = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    small_mbs = _micro_batches(rows, 40, row_tokens=20)
    assert len(small_mbs) >= 4
    big.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    small.forward_backward(small_mbs, cfg, _tokens(rows))
    a, b = big.full_gradients(), small.full_gradients()
    assert max_abs_diff(a, b) < 1e-6 * max_abs(a)


def test_two_calls_with_the_step_denominator_equal_one_call(tiny_model_dir):
    rows = make_rows(10, seed=3)
    cfg = LossConfig()
    one, two = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    one.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    two.forward_backward(_micro_batches(rows[:4], 10_000), cfg, _tokens(rows))
    two.forward_backward(_micro_batches(rows[4:], 10_000), cfg, _tokens(rows))
    a, b = one.full_gradients(), two.full_gradients()
    assert max_abs_diff(a, b) < 1e-6 * max_abs(a)


def test_optim_step_is_clip_then_adamw(tiny_model_dir, tmp_path):
    rows = make_rows(8, seed=4)
    cfg = LossConfig()
    trainer = _trainer(tiny_model_dir, lr=1e-2, max_grad_norm=0.05)
    trainer.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    out = trainer.optim_step()
    ref = reference(tiny_model_dir, rows, cfg)
    assert out["grad_norm"] == pytest.approx(
        adamw_step(ref["model"], lr=1e-2, max_grad_norm=0.05), rel=1e-5
    )
    assert out["grad_norm"] > 0.05  # the clip was active
    trainer.export_hf(tmp_path / "hf")
    exported = dict(load(tmp_path / "hf").named_parameters())
    expected = dict(ref["model"].named_parameters())
    # Adam's first update is lr * g / (|g| + eps): for entries with |g| near eps, fp32 rounding of
    # the gradient moves it by a visible fraction of lr.
    assert (
        max_abs_diff(
            {k: v.detach() for k, v in exported.items()},
            {k: v.detach() for k, v in expected.items()},
        )
        < 1e-3 * 1e-2
    )


def test_kl_to_the_reference_model(tiny_model_dir, tmp_path):
    """After one step the policy differs from the reference: the KL term's gradient is exact."""
    rows = make_rows(8, seed=5)
    cfg = LossConfig(kl_coef=0.5)
    trainer = _trainer(tiny_model_dir, reference_model_path=str(tiny_model_dir))
    trainer.forward_backward(_micro_batches(rows, 10_000), LossConfig(), _tokens(rows))
    trainer.optim_step()
    trainer.export_hf(tmp_path / "moved")
    out = trainer.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    ref = reference(tmp_path / "moved", rows, cfg, ref_dir=tiny_model_dir)
    assert out["sums"]["kl_sum"] > 0
    assert max_abs_diff(trainer.full_gradients(), ref["grads"]) < 1e-6 * max_abs(ref["grads"])


def test_forward_returns_each_sequences_logprobs(tiny_model_dir):
    rows = make_rows(7, seed=6)
    trainer = _trainer(tiny_model_dir)
    got = dict(trainer.forward(_micro_batches(rows, 30, row_tokens=16)))
    ref = reference(tiny_model_dir, rows)
    for r, expected in zip(rows, ref["logprobs"], strict=True):
        assert torch.allclose(
            torch.tensor(got[(r["group_index"], r["sample_index"])]), expected, atol=1e-5
        )


def test_checkpoint_round_trip_continues_identically(tiny_model_dir, tmp_path):
    rows = make_rows(6, seed=7)
    cfg = LossConfig()
    a = _trainer(tiny_model_dir, lr_warmup_steps=3)
    a.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
    a.optim_step()
    a.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == [
        "model.safetensors"
    ]
    b = _trainer(tmp_path / "ckpt", lr_warmup_steps=3)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 1 and b.backend.current_lr() == pytest.approx(a.backend.current_lr())
    for trainer in (a, b):
        trainer.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
        trainer.optim_step()
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    assert max_abs_diff(wa, wb) == 0.0


def test_the_warm_up_changes_nothing_the_steps_after_it_see(tiny_model_dir):
    """``warm_up`` runs a step's code before the first batch (rank_main calls it at start): two
    steps after it equal, to the bit, two steps of a trainer that did not warm up."""
    rows = make_rows(8, seed=8)
    cfg = LossConfig()
    cold, warm = (
        _trainer(tiny_model_dir, lr=1e-2, weight_decay=0.1, lr_warmup_steps=3) for _ in range(2)
    )
    rng = torch.get_rng_state()
    assert warm.warm_up() > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert not warm.backend.optimizer.state and warm.backend.scheduler.last_epoch == 0
    assert max_abs_diff(dict(cold.named_weights()), dict(warm.named_weights())) == 0.0
    outs = {}
    for name, trainer in (("cold", cold), ("warm", warm)):
        for _ in range(2):
            trainer.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
            outs.setdefault(name, []).append(trainer.optim_step())
    for a, b in zip(outs["cold"], outs["warm"], strict=True):
        assert (a["grad_norm"], a["lr"]) == (b["grad_norm"], b["lr"])
    assert max_abs_diff(dict(cold.named_weights()), dict(warm.named_weights())) == 0.0


def test_optim_step_without_gradients_is_an_error(tiny_model_dir):
    with pytest.raises(RuntimeError, match="no gradients"):
        _trainer(tiny_model_dir).optim_step()


@pytest.mark.parametrize("token_mean", ["batch", "mini_batch"])
def test_a_step_without_loss_tokens_has_a_zero_loss_and_gradient(
    tiny_model_dir, tmp_path, token_mean
):
    """Every row all environment tokens (no token the model wrote): nothing to learn, and no
    division by zero tokens in the train task or the trainer's ops (it raised under "batch",
    and divided by zero under "mini_batch")."""
    from unittest import mock

    from rollflow.infra.storage import RunStorage
    from rollflow.tasks.advantage.advantages import num_loss_tokens
    from rollflow.tasks.train.train_task import step_denominator
    from rollflow.trainer.batches import BatchReader
    from rollflow.trainer.compute import StepOps
    from rollflow.trainer.control import ControlGroup
    from rollflow.trainer.protocol import ForwardBackward

    from trainer_support import write_batch

    rows = [{**r, "completion_mask": [0] * len(r["completion_ids"])} for r in make_rows(8)]
    storage = RunStorage(str(tmp_path), "t")
    write_batch(storage, 1, rows)
    tokens = num_loss_tokens(storage.read_step_table("batches", 1))
    assert tokens == 0
    with mock.patch.dict("os.environ"):  # ControlGroup names a gloo interface in the env
        control = ControlGroup(timeout_s=60)
    reader = BatchReader(storage, 0, 1, micro_batch_tokens=64, row_tokens=None)
    ops = StepOps(_trainer(tiny_model_dir), control, reader)
    denominator = step_denominator(tokens, 1, TrainSection(token_mean=token_mean))
    out = ops.forward_backward(
        ForwardBackward(step=1, group_indices=[0, 1], num_loss_tokens=denominator)
    )
    assert out["loss"] == 0.0 and out["num_loss_tokens"] == 0
    assert max_abs(ops.trainer.full_gradients()) == 0.0


def test_a_batch_token_mean_without_the_steps_loss_tokens_is_a_callers_error():
    from rollflow.tasks.train.train_task import step_denominator

    with pytest.raises(ValueError, match="needs the step's loss tokens, none given"):
        step_denominator(None, 2, TrainSection(token_mean="batch"))
    assert step_denominator(None, 2, TrainSection(token_mean="mini_batch")) is None


def test_resuming_with_another_backend_says_which(tiny_model_dir, tmp_path):
    a = _trainer(tiny_model_dir)
    a.save_checkpoint(tmp_path / "ckpt")
    state = tmp_path / "ckpt" / "trainer" / "state.json"
    state.write_text(state.read_text().replace('"fsdp2"', '"deepspeed"'))
    with pytest.raises(ValueError, match="trainer.backend = 'deepspeed'"):
        _trainer(tmp_path / "ckpt").load_checkpoint(tmp_path / "ckpt")


def _wire_bytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def test_weights_travel_in_the_serving_dtype(tiny_model_dir):
    """A sync sends what vLLM serves (bf16 on GPUs), and its metadata announces those bytes:
    half the fp32 bytes, and a receiver that waits for exactly what arrives (issue 26, item 11)."""
    spec = TrainerSpec(model_path=str(tiny_model_dir), weight_dtype="bfloat16")
    trainer = Trainer(spec, CPU)
    named = trainer.sync_weights()
    assert {t.dtype for _, t in named} == {torch.bfloat16}
    assert {m["dtype"] for m in trainer.metadata} == {"bfloat16"}
    assert _wire_bytes(named) == metadata_bytes(trainer.metadata)
    fp32 = dict(trainer.named_weights())  # checkpoints and exports stay in the masters' fp32
    assert all(t.dtype == torch.float32 for t in fp32.values())
    for name, t in named:
        torch.testing.assert_close(t, fp32[name].to(torch.bfloat16))


def test_a_backend_holding_bf16_copies_sends_what_it_announces(tiny_model_dir, monkeypatch):
    """DeepSpeed bf16 casts the parameters after the engine is built (ZeRO-3 gathers 16-bit):
    its full state dict is bf16 while the model the metadata was read from was fp32. The bytes
    sent must still be the bytes announced (issue 26, item 1: else the receiver blocks)."""
    trainer = _trainer(tiny_model_dir)  # serving dtype float32, as on CPU
    full = trainer.backend.full_state_dict
    monkeypatch.setattr(
        trainer.backend,
        "full_state_dict",
        lambda **kw: {k: v.to(torch.bfloat16) for k, v in full(**kw).items()},
    )
    named = trainer.sync_weights()
    assert _wire_bytes(named) == metadata_bytes(trainer.metadata)
    assert {t.dtype for _, t in named} == {torch.float32}


def test_bf16_mixed_precision_on_cpu_keeps_fp32_masters(tiny_model_dir):
    """trainer.mixed_precision = "bf16" computes in bf16 on CPU too (the GPU's numerics, for the
    simulation), with fp32 master weights: log-probs close to fp32's, not equal."""
    rows = make_rows(8, seed=3)
    out = {}
    for mode in ("off", "bf16"):
        spec = TrainerSpec(
            model_path=str(tiny_model_dir),
            trainer=TrainerServiceSection(mixed_precision=mode),
        )
        trainer = Trainer(spec, CPU)
        logps = dict(trainer.forward(_micro_batches(rows, 10_000)))
        out[mode] = torch.tensor([x for key in sorted(logps) for x in logps[key]])
        masters = [p for g in trainer.backend.optimizer.param_groups for p in g["params"]]
        assert masters and all(p.dtype == torch.float32 for p in masters)
    diff = (out["bf16"] - out["off"]).abs().max()
    assert 0 < diff < 0.1
