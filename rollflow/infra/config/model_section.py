"""``[model]``: the policy, a Hugging Face model or a tiny one built locally."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rollflow.infra.config.base import Section

DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=:,>() "


class TinyModelSpec(Section):
    """Shape of a tiny character Llama built from scratch."""

    alphabet: str = Field(
        DEFAULT_ALPHABET,
        min_length=1,
        description="Characters the tokenizer knows, one token each (no character twice).",
    )
    hidden_size: int = Field(128, ge=8, description="Model width.")
    intermediate_size: int = Field(256, ge=8, description="MLP width.")
    num_layers: int = Field(2, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads (no GQA).")
    max_position_embeddings: int = Field(
        64, ge=8, description="Longest prompt + completion; vLLM gives NaN logprobs past it."
    )
    seed: int = Field(0, description="Seed of the random initialisation.")

    @field_validator("alphabet")
    @classmethod
    def _distinct(cls, alphabet: str) -> str:
        repeated = sorted({ch for ch in alphabet if alphabet.count(ch) > 1})
        if repeated:
            raise ValueError(
                f"model.tiny.alphabet repeats {''.join(repeated)!r}: give each character once"
            )
        return alphabet

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelSpec:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim not in (32, 64, 128):
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be 32, 64 or 128: "
                "vLLM's CPU attention supports no other head size"
            )
        return self


class ModelSection(Section):
    """The policy: a Hugging Face directory or hub id, or a tiny model built locally."""

    path: str | None = Field(
        None, description="HF model directory or hub id. Exclusive with `tiny`."
    )
    tiny: TinyModelSpec | None = Field(None, description="Build a tiny character Llama instead.")
    revision: str | None = Field(
        None,
        description="The hub revision of model.path (a branch, tag or commit) that the trainer, "
        "the tokenizer and vLLM load; None: the default branch.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Let the trainer, the tokenizer and vLLM run the model repository's own code "
        "(an architecture transformers does not ship); only for repositories you trust.",
    )
    warm_start_target: float = Field(
        0.35,
        ge=0,
        le=1,
        description="Tiny models only: supervised warm-start stops at this held-out accuracy.",
    )
    warm_start_max_steps: int = Field(
        3000, ge=0, description="Tiny models only: cap on warm-start steps."
    )
    warm_start_lr: float = Field(
        1e-3, gt=0, description="Tiny models only: warm-start learning rate."
    )
    cache_dir: str = Field(
        "~/.cache/rollflow/models", description="Where built tiny models are cached."
    )

    def vllm_args(self) -> list[str]:
        """``revision`` and ``trust_remote_code`` as ``vllm serve`` flags."""
        args = ["--revision", self.revision] if self.revision else []
        return args + (["--trust-remote-code"] if self.trust_remote_code else [])

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.tiny is None):
            raise ValueError(
                "set exactly one of model.path (a HF model) or [model.tiny] (a built tiny model)"
            )
        return self
