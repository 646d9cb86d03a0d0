"""The policy as the trainer runs it: packed rows in, fp32 log-probs and entropy of chosen tokens out.

``PackedPolicy`` wraps a Hugging Face causal LM. Its forward runs the decoder on packed rows
(``position_ids`` restart per sequence, no attention mask: see ``packing``), keeps only the
hidden states that predict a loss token, and computes their log-prob and entropy with the chunked
kernel of ``gpu_kernels.logprobs`` in fp32 (never the full tokens x vocab logits; Triton on
CUDA). Prompt positions never reach the LM head.

The wrapper is the root module the backends shard (FSDP2) or hand to DeepSpeed, so the LM head's
weight is gathered by the root's own hooks; under ZeRO-3 it is registered as an external
parameter of the wrapper, since the head module itself is never called.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from rollflow.gpu_kernels import varlen_attention
from rollflow.gpu_kernels.logprobs import selective_logprobs_entropy
from rollflow.infra.errors import ConfigError

PREFIX = "hf."  # state-dict keys of the wrapper are the HF model's, behind this prefix


class PackedPolicy(nn.Module):
    """A causal LM returning (logprobs_N, entropy_N) of the tokens it is asked about."""

    def __init__(self, hf_model: nn.Module, temperature: float = 1.0, top_p: float = 1.0):
        super().__init__()
        if getattr(hf_model.config, "final_logit_softcapping", None):
            raise ConfigError(
                f"model.path: {type(hf_model).__name__} soft-caps its logits, and the trainer's "
                "log-prob kernel computes plain lm_head logits: pick a model without "
                "final_logit_softcapping"
            )
        self.hf = hf_model
        # The distribution the rollouts were sampled from (SamplingSection.behaviour): the
        # log-probs of every ratio, entropy and KL are of it, as vLLM's processed log-probs are.
        self.temperature, self.top_p = temperature, top_p

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def decoder_layers(self) -> list[nn.Module]:
        """The transformer blocks (the units FSDP2 shards one by one)."""
        layers = getattr(self.hf.base_model, "layers", None)
        if layers is None:
            raise ConfigError(
                f"model.path: {type(self.hf).__name__} has no `.layers` on its base model for "
                "FSDP2 to shard: set trainer.backend = 'deepspeed'"
            )
        return list(layers)

    def checkpoint_activations(self) -> None:
        """Recompute each decoder layer's activations in the backward pass instead of keeping
        them (non-reentrant ``torch.utils.checkpoint``), whether the model is in train mode or not.

        The layer's ``forward`` is wrapped, not the module: parameter names stay HF's, and the
        hooks FSDP2's ``fully_shard`` puts on the layer's call (gather, reshard) stay outside
        the recomputed region, as with torchtitan's checkpoint-then-shard order. Call it before
        the backend shards the policy."""
        for layer in self.decoder_layers():
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)

    def forward(
        self,
        input_ids_R_P: torch.Tensor,
        position_ids_R_P: torch.Tensor,
        hidden_index_N: torch.Tensor,
        targets_N: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.hf.base_model(
            input_ids=input_ids_R_P,
            position_ids=position_ids_R_P,
            attention_mask=None,
            use_cache=False,
        )
        hidden_RP_H = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        hidden_N_H = hidden_RP_H.index_select(0, hidden_index_N)
        return selective_logprobs_entropy(
            hidden_N_H,
            self.lm_head_weight,
            targets_N,
            temperature=self.temperature,
            top_p=self.top_p,
        )


def attention_implementation(device: torch.device) -> str:
    """The attention packed rows run with: never a dense mask across sequences on GPU.

    On CUDA: flash-attention 2 when the package is installed, else rollflow's varlen attention
    (torch's varlen flash kernel over the sequence boundaries; ``gpu_kernels.varlen_attention``).
    transformers' sdpa would build a [P, P] mask per packed row (1 GiB at 32k tokens) and do
    attention work quadratic in the row. On CPU rows are kept short and sdpa's mask is cheap.
    """
    if device.type != "cuda":
        return "sdpa"
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return varlen_attention.register()


def load_hf_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The HF model in ``dtype`` on CPU (backends move or shard it), with an attention that packs
    (``revision``, ``trust_remote_code``: model.revision and model.trust_remote_code)."""
    hub = {"revision": revision, "trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(path, **hub)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        torch_dtype=dtype,
        attn_implementation=attention_implementation(device),
        **hub,
    )
    return model


def hf_name(key: str) -> str:
    """A wrapper state-dict key as the HF model names it."""
    return key[len(PREFIX) :] if key.startswith(PREFIX) else key
