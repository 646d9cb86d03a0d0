"""LoRA on the trainer (one in-process gloo rank, FSDP2): only adapters train, the merged weights
and the saved adapter are what peft computes, and a checkpoint round trip continues exactly."""

import json

import pytest
import torch
from test_trainer import _micro_batches, _tokens, one_rank  # noqa: F401 (one_rank: autouse, one gloo rank)

from rollflow.infra.config import LoraSection, LossConfig, TrainSection
from rollflow.infra.errors import ConfigError
from rollflow.trainer import lora
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

from trainer_support import load, make_rows, max_abs_diff

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


def _trainer(model_dir, **train) -> Trainer:
    train = TrainSection(**{"lr": 1e-2, "max_grad_norm": 1e9, "lora": LORA, **train})
    return Trainer(TrainerSpec(model_path=str(model_dir), train=train), CPU)


def _randomised(model_dir):
    """The tiny model with adapters whose B is random (peft starts B at zero)."""
    model = load(model_dir)
    lora.apply_lora(model, LORA)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_only_the_adapters_train(tiny_model_dir):
    model = load(tiny_model_dir)
    lora.apply_lora(model, LORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable)
    assert not any("k_proj.lora" in n for n in trainable)


def test_unmatched_target_modules_are_named(tiny_model_dir):
    with pytest.raises(ConfigError, match="train.lora.target_modules \\['nope'\\] matched no"):
        lora.apply_lora(load(tiny_model_dir), LoraSection(target_modules=["nope"]))


def test_merged_weights_and_saved_adapter_equal_peft(tiny_model_dir, tmp_path):
    model = _randomised(tiny_model_dir)
    full = model.state_dict()
    merged = lora.merged_state(full, LORA)
    assert set(merged) == set(load(tiny_model_dir).state_dict())
    folder = lora.save_adapter(tmp_path / "adapter", full, LORA, str(tiny_model_dir))
    # peft loads our adapter folder onto the base model; its merge is ours.
    by_peft = peft.PeftModel.from_pretrained(load(tiny_model_dir), folder).merge_and_unload()
    assert max_abs_diff(merged, by_peft.state_dict()) < 1e-6
    base = load(tiny_model_dir).state_dict()
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed and all(
        k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for k in changed
    )
    assert lora.adapter_num_bytes(full) == sum(
        p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n
    )


def test_a_lora_step_moves_only_the_adapters_and_exports_them(tiny_model_dir, tmp_path):
    rows = make_rows(12, seed=2)
    trainer = _trainer(tiny_model_dir)
    before = {k: v.clone() for k, v in trainer.backend.full_state_dict().items()}
    assert dict(trainer.named_weights()).keys() == {m["name"] for m in trainer.metadata}
    trainer.forward_backward(_micro_batches(rows, 10_000), LossConfig(), _tokens(rows))
    trainer.optim_step()
    after = trainer.backend.full_state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(".lora_B." in k or ".lora_A." in k for k in moved)
    # The HF export is the merged model, and adapter/ reloads with peft to the same log-probs.
    folder = trainer.export_hf(tmp_path / "export")
    ours = dict(trainer.forward(_micro_batches(rows, 10_000)))
    merged = load(folder)
    with_adapter = peft.PeftModel.from_pretrained(load(tiny_model_dir), folder / lora.ADAPTER_DIR)
    for model in (merged, with_adapter):
        for row in rows[:4]:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            with torch.no_grad():
                logp = model(ids).logits.float().log_softmax(-1)[0, :-1]
            n = len(row["completion_ids"])
            got = logp[-n:].gather(-1, ids[0, -n:, None])[:, 0]
            expected = torch.tensor(ours[(row["group_index"], row["sample_index"])])
            assert torch.allclose(got, expected, atol=1e-5)


def test_lora_checkpoint_round_trip_continues_identically(tiny_model_dir, tmp_path):
    rows = make_rows(8, seed=3)
    cfg = LossConfig()

    def step(t):
        t.forward_backward(_micro_batches(rows, 10_000), cfg, _tokens(rows))
        t.optim_step()

    first = _trainer(tiny_model_dir)
    step(first)
    first.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / lora.ADAPTER_DIR / "adapter_model.safetensors").exists()
    step(first)
    resumed = _trainer(tmp_path / "ckpt")  # a resumed run starts from the checkpoint's folder
    resumed.load_checkpoint(tmp_path / "ckpt")
    step(resumed)
    assert max_abs_diff(dict(first.named_weights()), dict(resumed.named_weights())) < 1e-6
    # The resumed trainer started from the merged export; its adapter still names the base.
    resumed.save_checkpoint(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / lora.ADAPTER_DIR / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_model_dir)


def test_an_adapter_sync_sends_the_adapter_alone(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, lora=LORA.model_copy(update={"sync": "adapter"}))
    rows = make_rows(8, seed=4)
    trainer.forward_backward(_micro_batches(rows, 10_000), LossConfig(), _tokens(rows))
    trainer.optim_step()
    sent = trainer.sync_weights()
    full = trainer.backend.full_state_dict()
    assert [name for name, _ in sent] == [m["name"] for m in trainer.metadata]
    assert max_abs_diff(dict(sent), lora.adapter_state(full)) == 0
    assert sum(t.numel() * t.element_size() for _, t in sent) == lora.adapter_num_bytes(full)
    # What vLLM serves before the first sync: peft's own adapter layout, and the base model.
    folder = lora.save_initial_adapter(tmp_path / "v0", tiny_model_dir, LORA)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (LORA.rank, LORA.alpha)
    with_zero = peft.PeftModel.from_pretrained(load(tiny_model_dir), folder).merge_and_unload()
    assert max_abs_diff(with_zero.state_dict(), load(tiny_model_dir).state_dict()) == 0
    from safetensors.torch import load_file

    zero = load_file(folder / "adapter_model.safetensors")
    assert {k: list(v.shape) for k, v in zero.items()} == {
        m["name"]: m["shape"] for m in trainer.metadata
    }
