"""``[train.loss]`` and ``[train.lora]``: the policy loss and LoRA adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollflow.infra.config.base import Section

# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LossConfig(Section):
    """The policy loss, one model for the config, the trainer's API and its ranks (``losses.py``).

    The ratio is clipped to [1 - eps_low, 1 + eps_high]: per token for PPO (0.2 / 0.28 are
    usual), per sequence for GSPO, whose ratio stays much closer to 1 (its paper: 3e-4 / 4e-4).
    """

    kind: Literal["ppo", "gspo"] = Field(
        "ppo", description="Token-level PPO clip, or GSPO (the sequence's geometric-mean ratio)."
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="Clip: lower epsilon.")
    eps_high: float = Field(0.2, ge=0, description="Clip: upper epsilon.")
    tis_cap: float | None = Field(
        None,
        ge=1,
        description="Truncated importance sampling cap C: min(exp(old - inference), C); unset = off. "
        "At least 1, so that on-policy tokens (weight 1) are never scaled down.",
    )
    is_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Rollout correction between sampler and trainer: the importance ratio "
        "exp(old - inference) per token, per sequence (product over its tokens), or the "
        "sequence's geometric mean; tis_cap truncates it, mask_low/mask_high drop what leaves the band.",
    )
    mask_low: float | None = Field(
        None,
        ge=0,
        description="Tokens (or sequences, at sequence/geometric level) whose importance ratio is "
        "below this are dropped from the loss; unset = no lower bound.",
    )
    mask_high: float | None = Field(
        None,
        gt=0,
        description="... above this are dropped from the loss; unset = no upper bound.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="k3 KL penalty to the initial policy (the trainer loads a reference model).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")

    @model_validator(mode="after")
    def _mask_band(self) -> LossConfig:
        if self.mask_low is not None and self.mask_high is not None:
            if not self.mask_low < 1 < self.mask_high:
                raise ValueError(
                    f"train.loss.mask_low < 1 < train.loss.mask_high must hold (got "
                    f"{self.mask_low}, {self.mask_high}): on-policy tokens (ratio 1) must be kept"
                )
        return self

    @property
    def corrects(self) -> bool:
        """Whether any rollout correction (truncation or masking) is on."""
        return self.tis_cap is not None or self.mask_low is not None or self.mask_high is not None


class LoraSection(Section):
    """LoRA adapters ([train.lora], with peft): only the adapters train (docs/lora.md)."""

    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(
        32.0, gt=0, description="Scale numerator: the update is (alpha / r) · B A."
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input, in forward_backward only."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
        description="Names (suffixes) of the linear layers that get an adapter.",
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="What a weight sync sends vLLM: the merged model W + (alpha / r) · B A (vLLM "
        "generates at the base model's speed), or the adapter alone (vLLM serves it with "
        "--enable-lora: far fewer bytes, slower generation on CPU). docs/lora.md, 'Decision'.",
    )

    @model_validator(mode="after")
    def _servable(self) -> LoraSection:
        if self.sync == "adapter" and self.rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(
                f"train.lora.rank = {self.rank} with train.lora.sync = 'adapter': vLLM serves "
                f"adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}; lower the rank or sync 'merged'"
            )
        return self
