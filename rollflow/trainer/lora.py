"""LoRA adapters on the trainer's policy (``[train.lora]``), with peft.

The adapter is injected into the Hugging Face model in place (``peft.inject_adapter_in_model``),
before the backend shards it: the module tree keeps its HF shape, the frozen base weight of each
adapted linear layer becomes ``<layer>.base_layer.weight`` and its adapter
``<layer>.lora_A.default.weight`` (r x in) and ``<layer>.lora_B.default.weight`` (out x r).
Only the adapters train; checkpoints keep the whole state, so a resume restores both.

What leaves the trainer:

- ``merged_state``: W + (alpha / r) · B A for every adapted layer, under the HF names: the
  weights the weight group sends to vLLM under ``train.lora.sync = "merged"`` and the
  checkpoint's HF export;
- ``adapter_state`` / ``save_adapter``: the adapter alone in peft's format
  (``adapter_model.safetensors`` + ``adapter_config.json``), which ``PeftModel.from_pretrained``
  and vLLM's ``--lora-modules`` load; ``adapter_state`` is what the weight group sends under
  ``train.lora.sync = "adapter"``, and ``save_initial_adapter`` what vLLM serves before the first
  sync (docs/lora.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from rollflow.infra import export
from rollflow.infra.config import LoraSection
from rollflow.infra.errors import ConfigError

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = export.ADAPTER  # a checkpoint's sub-folder holding the adapter alone
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer.weight"


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "train.lora needs the peft package (pip install 'peft>=0.21'); or remove [train.lora]"
        ) from exc
    return peft


def peft_config(cfg: LoraSection):
    """The peft ``LoraConfig`` of ``[train.lora]``."""
    return _peft().LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )


def apply_lora(model: nn.Module, cfg: LoraSection, seed: int = 0) -> list[nn.Module]:
    """Inject the adapter into ``model`` in place; freeze everything else.

    Returns the adapter's dropout modules: the trainer puts them in train mode for
    ``forward_backward`` only (HF models load in eval mode, and the ratio's old log-probs must
    come without dropout). B starts at zero (peft's default), so the policy starts as the base.
    """
    unmatched = ConfigError(
        f"train.lora.target_modules {list(cfg.target_modules)} matched no linear layer of "
        f"{type(model).__name__}; name its projections (e.g. q_proj, v_proj)"
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            _peft().inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
        except ValueError as exc:
            if "not found in the base model" in str(exc):
                raise unmatched from None
            raise
    if not any(name.endswith(_A) for name, _ in model.named_parameters()):
        raise unmatched
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return [m for name, m in model.named_modules() if name.endswith(f"lora_dropout.{ADAPTER}")]


@contextmanager
def dropout_active(dropouts: list[nn.Module]) -> Iterator[None]:
    """Adapter dropout in train mode inside the block (``forward_backward``), eval mode after."""
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()


def merged_state(full: dict[str, torch.Tensor], cfg: LoraSection) -> dict[str, torch.Tensor]:
    """HF-named weights with every adapter merged: W + (alpha / r) · B A (in W's dtype)."""
    scale = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if key.endswith((_A, _B)):
            continue
        if key.endswith(_BASE):
            layer = key[: -len(_BASE)]
            a, b = full[layer + _A].float(), full[layer + _B].float()
            # One fused product-and-add: a single full-size result per layer.
            merged = torch.addmm(value.float(), b, a, alpha=scale)
            out[f"{layer}.weight"] = merged.to(value.dtype)
        else:
            out[key.replace(".base_layer.", ".")] = value
    return out


def adapter_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<layer>.lora_A.weight``)."""
    return {
        "base_model.model." + key.replace(f".{ADAPTER}.weight", ".weight"): value.contiguous()
        for key, value in full.items()
        if key.endswith((_A, _B))
    }


def save_adapter(
    folder: str | Path, full: dict[str, torch.Tensor], cfg: LoraSection, base_model: str
) -> Path:
    """Write the adapter as peft saves it: ``adapter_model.safetensors`` + ``adapter_config.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(full), folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = peft_config(cfg).to_dict()
    config.update(base_model_name_or_path=base_model, inference_mode=True)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    return folder


def save_initial_adapter(folder: str | Path, model_dir: str | Path, cfg: LoraSection) -> Path:
    """The adapter a run starts from, for vLLM to serve before the first sync: B = 0 (so the
    policy is the base model) and A = 0 too (no random draw to keep in step with the trainer).

    Its shapes come from the model's architecture on the meta device: no weight is loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    apply_lora(model, cfg)
    zeros = {
        k: torch.zeros(v.shape, dtype=v.dtype)
        for k, v in model.state_dict().items()
        if k.endswith((_A, _B))
    }
    return save_adapter(folder, zeros, cfg, str(model_dir))


def adapter_num_bytes(full: dict[str, torch.Tensor]) -> int:
    """Bytes of the adapter's tensors (what an adapter-only sync would send)."""
    return sum(v.numel() * v.element_size() for k, v in full.items() if k.endswith((_A, _B)))
