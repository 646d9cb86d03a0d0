"""One typed config tree for a run, loaded from TOML with ``key.path=value`` overrides.

Every section forbids unknown keys, so a misspelt key fails at load time with a message that
names it (and suggests the closest known key). Cross-field checks live in one validator on
``RunConfig`` with messages a user can act on.
"""

from __future__ import annotations

import copy
import difflib
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollflow.infra.errors import ConfigError

DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=:,>() "


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelSpec(_Section):
    """Shape of a tiny character Llama built from scratch."""

    alphabet: str = Field(DEFAULT_ALPHABET, description="Characters the tokenizer knows.")
    hidden_size: int = Field(128, ge=8, description="Model width.")
    intermediate_size: int = Field(256, ge=8, description="MLP width.")
    num_layers: int = Field(2, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads (no GQA).")
    max_position_embeddings: int = Field(
        64, ge=8, description="Longest prompt + completion; vLLM gives NaN logprobs past it."
    )
    seed: int = Field(0, description="Seed of the random initialisation.")

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelSpec:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim not in (32, 64, 128):
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be 32, 64 or 128: "
                "vLLM's CPU attention supports no other head size"
            )
        return self


class RunSection(_Section):
    """Identity of the run and where its data lands."""

    name: str = Field(
        "quickstart", pattern=r"^[A-Za-z0-9_.-]+$", description="Run name; storage sub-folder."
    )
    storage: str = Field("runs", description="Storage root: a local folder or an s3:// URI.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options, e.g. {endpoint_url=...} for S3. Credentials given here "
        "(key, secret, token, ...) are taken out before the config is stored (infra/secrets.py).",
    )
    storage_secret: str | None = Field(
        None,
        description="Name of a Prefect Secret block holding a JSON object of fsspec options "
        "(credentials), merged into storage_options at run time; never stored with the config. "
        "Needs a Prefect server (PREFECT_API_URL). Without it, use the environment "
        "(AWS_ACCESS_KEY_ID, ...).",
    )
    seed: int = Field(0, description="Seed for prompt order and sampling.")
    num_steps: int = Field(40, ge=1, description="Outer training steps (weight syncs).")
    eval_every: int = Field(
        10, ge=0, description="Held-out evaluation every N steps (0: only at start and end)."
    )
    checkpoint_every: int = Field(
        1, ge=1, description="Checkpoint every N steps; resume restarts after the last one."
    )


class ModelSection(_Section):
    """The policy: a Hugging Face directory or hub id, or a tiny model built locally."""

    path: str | None = Field(
        None, description="HF model directory or hub id. Exclusive with `tiny`."
    )
    tiny: TinyModelSpec | None = Field(None, description="Build a tiny character Llama instead.")
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

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.tiny is None):
            raise ValueError(
                "set exactly one of model.path (a HF model) or [model.tiny] (a built tiny model)"
            )
        return self


class EnvSpec(_Section):
    """One environment of the mix."""

    name: str = Field(
        description="Built-in name (`add`, `sort_letters`) or `package.module:Class`."
    )
    weight: float = Field(
        1.0, gt=0, description="Share of the training prompts drawn from this env."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env.")


class PromptSection(_Section):
    """How prompts become token ids (``tasks/generate/chat.py``)."""

    system: str | None = Field(
        None,
        description="System prompt put first in every chat-formatted prompt, unless the env's "
        "messages start with their own.",
    )
    chat_template: Literal["messages", "always", "never"] = Field(
        "messages",
        description="When the tokenizer's chat template renders a prompt: 'messages' for prompts "
        "an env gives as chat messages (raw text goes as it is), 'always' (raw text too, as one "
        "user message), 'never' (a base model: message prompts are refused).",
    )


class SamplingSection(_Section):
    """How rollouts are sampled from vLLM."""

    group_size: int = Field(8, ge=2, description="Completions per prompt (one GRPO group).")
    max_tokens: int = Field(8, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for training rollouts.")
    eval_temperature: float = Field(
        0.0, ge=0, description="Temperature of held-out evaluation (0 = greedy)."
    )
    num_eval_prompts: int = Field(
        256, ge=1, description="Held-out prompts per environment per evaluation."
    )

    def behaviour(self) -> tuple[float, float]:
        """(temperature, top_p) of the distribution training rollouts are sampled from.

        The trainer takes its log-probs at these and vLLM returns processed log-probs (after
        temperature and top-p), so the behaviour policy of every ratio is the one that sampled.
        Greedy (temperature 0) has no distribution: vLLM then returns raw temperature-1
        log-probs, and so does the trainer.
        """
        if self.temperature == 0:
            return 1.0, 1.0
        return self.temperature, self.top_p


class LossConfig(_Section):
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


# Policy versions and staleness are steps with fractions (a step's optimizer steps / its
# optimizer steps): comparisons of two of them allow this much rounding.
STALENESS_EPS = 1e-6
# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSection(_Section):
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


class TrainSection(_Section):
    """The algorithm: GRPO advantages, the policy loss (PPO clip or GSPO), mini-batches and epochs."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    train_batch_size: int = Field(64, ge=1, description="Groups per outer step (one weight sync).")
    mini_batch_size: int = Field(64, ge=1, description="Groups per optimizer step.")
    max_staleness: float = Field(
        0,
        ge=0,
        description="Steps generation may run ahead of training (0 = on-policy). A fraction counts "
        "optimizer steps: with 4 optimizer steps per step, 0.25 lets the next step's groups start "
        "from the weights after this step's 3rd (sent to vLLM mid-step, while the 4th trains).",
    )
    sync_every: int = Field(
        1,
        ge=1,
        description="Sync weights to vLLM every N outer steps (and at evaluations); needs max_staleness >= N - 1.",
    )
    max_in_flight_groups: int | None = Field(
        None,
        ge=1,
        description="Groups generating at once (K); default train_batch_size * (whole steps of "
        "max_staleness + 1).",
    )
    advantage: str = Field(
        "grpo",
        description="Advantage estimator: grpo, dr_grpo, rloo, pass_at_k, or "
        "package.module:function (one group's rewards in, one float per sample out).",
    )
    advantage_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the estimator, e.g. {k = 4} for pass_at_k.",
    )
    normalize_std: bool = Field(
        False, description="grpo only: divide group advantages by the group's reward std."
    )
    filter_zero_advantage: bool = Field(
        True, description="Drop groups whose advantages are all zero."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a finished group whose advantages are all zero is "
        "replaced by a newly sampled one before a step takes it, under the same staleness bound.",
    )
    max_resampled_groups: int | None = Field(
        None,
        ge=0,
        description="Dynamic sampling's budget: groups replaced per step at most (default: "
        "train_batch_size, i.e. at most twice the sampling).",
    )
    truncated: Literal["keep", "drop", "penalize"] = Field(
        "keep",
        description="Samples cut short (a turn hit max_tokens, an episode its limits): trained as "
        "they are, dropped (DAPO overlong filtering) or penalised (DAPO soft overlong punishment).",
    )
    overlong_max_tokens: int | None = Field(
        None,
        ge=1,
        description="truncated = 'penalize': the length (model tokens) whose reward gets the whole "
        "penalty; default sampling.max_tokens (set it for multi-turn episodes).",
    )
    overlong_buffer_tokens: int = Field(
        0,
        ge=0,
        description="truncated = 'penalize': the penalty ramps up over this many tokens before "
        "overlong_max_tokens (0: only truncated samples are penalised).",
    )
    overlong_penalty: float = Field(
        1.0,
        ge=0,
        description="truncated = 'penalize': the largest penalty, subtracted from the reward.",
    )
    loss: LossConfig = Field(
        default_factory=LossConfig,
        description='The policy loss ([train.loss]); a string is its kind: train.loss = "gspo".',
    )
    lora: LoraSection | None = Field(
        None, description="[train.lora]: train LoRA adapters instead of every weight; unset = off."
    )
    old_logprobs: Literal["inference", "trainer"] = Field(
        "inference",
        description="Log-probs the ratio is taken against: the sampler's (no extra pass), or the trainer's own, "
        "computed by a forward pass over the step's batch before its first optimizer step.",
    )
    num_epochs: int = Field(
        1, ge=1, description="Passes over each step's batch (each mini-batch one optimizer step)."
    )
    mini_batch_split: Literal["groups", "samples"] = Field(
        "groups",
        description="How a step's batch becomes its mini-batches: whole groups, in order; or its "
        "samples in a seeded random order (TRL's steps_per_generation), so that each optimizer "
        "step sees samples of every group. Either way a mini-batch holds mini_batch_size groups' "
        "worth of samples.",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up, in optimizer steps."
    )

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_kind(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    def in_flight_groups(self) -> int:
        """K: groups the rollout producer keeps generating at once."""
        return self.max_in_flight_groups or self.train_batch_size * (self.whole_staleness() + 1)

    def optim_steps_per_step(self) -> int:
        """Optimizer steps of a full outer step: mini-batches times epochs."""
        return self.train_batch_size // self.mini_batch_size * self.num_epochs

    def whole_staleness(self) -> int:
        """The whole steps of ``max_staleness``."""
        return math.floor(self.max_staleness + STALENESS_EPS)

    def staleness_bound(self) -> float:
        """``max_staleness`` exactly: its whole steps plus ``sync_lag`` optimizer steps."""
        return self.whole_staleness() + self.sync_lag() / self.optim_steps_per_step()

    def sync_lag(self) -> int:
        """Optimizer steps of ``max_staleness``'s fraction: a step's weights go to vLLM that many
        optimizer steps before its end (0: at its end)."""
        frac = self.max_staleness - self.whole_staleness()
        return max(0, round(frac * self.optim_steps_per_step()))


class InferenceSection(_Section):
    """The vLLM inference deployment."""

    host: str = Field("127.0.0.1", description="Bind address of the vLLM server.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks a free one.")
    startup_timeout_s: float = Field(
        300, gt=0, description="Deadline for the server to become healthy."
    )
    request_timeout_s: float = Field(120, gt=0, description="Deadline of one completion request.")
    max_concurrency: int = Field(64, ge=1, description="Completion requests in flight at once.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of a dead vLLM server per run (0: a dead server fails the run).",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` arguments.")
    num_servers: int = Field(
        1, ge=1, description="vLLM servers (replicas); a group's completions stay on one server."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel workers per server (GPUs per server on a GPU node)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where vLLM runs; auto: CUDA when a GPU is visible, else CPU."
    )
    devices: list[int] | None = Field(
        None,
        description="GPU indices for the servers, tensor_parallel_size consecutive ones per "
        "server (None: the first GPUs of the node).",
    )
    colocate: bool = Field(
        False,
        description="vLLM shares the trainer's GPUs (one-GPU nodes): its memory share is capped "
        "at gpu_memory_utilization.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's share of each GPU's memory (None: vLLM's 0.9, or 0.45 when colocated).",
    )

    @field_validator("extra_args")
    @classmethod
    def _owned_args(cls, value: list[str]) -> list[str]:
        if any(arg.split("=")[0] == "--logprobs-mode" for arg in value):
            raise ValueError(
                "inference.extra_args may not set --logprobs-mode: rollflow serves "
                "processed_logprobs (the log-probs of the distribution that sampled, which the "
                "trainer matches); remove it"
            )
        return value


class TrainerSection(_Section):
    """The trainer service."""

    startup_timeout_s: float = Field(
        120, gt=0, description="Deadline for the trainer to become healthy."
    )
    request_timeout_s: float = Field(600, gt=0, description="Deadline of one trainer call.")
    weight_sync_timeout_s: float = Field(120, gt=0, description="Deadline of one weight broadcast.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one micro-batch.")
    backend: Literal["fsdp2", "deepspeed"] = Field(
        "fsdp2",
        description="Data-parallel backend: FSDP2 (torchrun) or DeepSpeed ZeRO (deepspeed launcher).",
    )
    num_ranks: int = Field(1, ge=1, description="Data-parallel ranks (processes) on this node.")
    zero_stage: Literal[1, 2, 3] | None = Field(
        None, description="DeepSpeed ZeRO stage (backend = deepspeed only; unset: 1)."
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description="Trainer nodes; rollflow starts node 0, `rollflow plan` prints the rest.",
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="Address of trainer node 0 as the other nodes reach it (rendezvous, weights).",
    )
    master_port: int = Field(
        29400, ge=1, le=65535, description="Rendezvous port on node 0 when num_nodes > 1."
    )
    devices: list[int] | None = Field(
        None,
        description="GPU indices of the trainer's ranks on each node (None: the GPUs vLLM leaves).",
    )
    weight_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Weight group transport: auto picks NCCL when trainer and vLLM are both on "
        "GPUs, else gloo through host memory.",
    )
    background_sync: bool = Field(
        True,
        description="Capture the weights when a step's training ends and release the trainer; "
        "the broadcast then runs while the next step trains (steps that checkpoint or evaluate "
        "still hold the trainer until their sync).",
    )
    weight_bucket_mb: float = Field(
        256,
        gt=0,
        description="Largest piece of one weight broadcast, in MiB (bounds extra memory).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the ranks compute: CUDA when available (auto), or forced."
    )


class WandbOptions(_Section):
    """Weights & Biases sink (used when metrics.sinks names "wandb")."""

    project: str = Field("rollflow", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); None: your default.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="offline writes under the run's log dir; upload later with `wandb sync`.",
    )


class MlflowOptions(_Section):
    """MLflow sink (used when metrics.sinks names "mlflow")."""

    tracking_uri: str | None = Field(
        None, description="e.g. http://host:5000 or sqlite:///mlflow.db; None: MLFLOW_TRACKING_URI."
    )
    experiment: str = Field("rollflow", description="MLflow experiment; created if missing.")


class MetricsSection(_Section):
    """Where each step's metrics row goes besides storage (metrics/step=N.parquet)."""

    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="Metric sinks; [] for storage only."
    )
    tensorboard_dir: str | None = Field(
        None, description="TensorBoard event folder; None: <the run's log dir>/tensorboard."
    )
    wandb: WandbOptions = Field(default_factory=WandbOptions)
    mlflow: MlflowOptions = Field(default_factory=MlflowOptions)

    @model_validator(mode="after")
    def _unique_sinks(self) -> MetricsSection:
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"metrics.sinks repeats a sink: {self.sinks}; name each once")
        return self


class RunConfig(_Section):
    """The whole run."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    envs: list[EnvSpec] = Field(min_length=1, description="Environment mix.")
    prompt: PromptSection = Field(default_factory=PromptSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    train: TrainSection = Field(default_factory=TrainSection)
    inference: InferenceSection = Field(default_factory=InferenceSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        t = self.train
        if t.mini_batch_size > t.train_batch_size:
            raise ValueError(
                f"train.mini_batch_size ({t.mini_batch_size}) must be <= train.train_batch_size "
                f"({t.train_batch_size}): a mini-batch is a slice of one outer batch"
            )
        if t.train_batch_size % t.mini_batch_size:
            raise ValueError(
                f"train.train_batch_size ({t.train_batch_size}) must be divisible by "
                f"train.mini_batch_size ({t.mini_batch_size})"
            )
        n, frac = t.optim_steps_per_step(), t.max_staleness - t.whole_staleness()
        if abs(frac * n - round(frac * n)) > 1e-3 * n or (0 < round(frac * n) >= n):
            raise ValueError(
                f"train.max_staleness ({t.max_staleness:g}): its fraction counts optimizer steps "
                f"out of the step's {n} (train_batch_size / mini_batch_size * num_epochs), so it "
                f"must be a whole number plus one of "
                f"{', '.join(f'{a / n:g}' for a in range(1, n)) or '(none: one optimizer step per step)'}"
            )
        if t.sync_lag() and t.sync_every != 1:
            raise ValueError(
                f"train.max_staleness = {t.max_staleness:g} sends weights mid-step, every step: it "
                f"needs train.sync_every = 1 (it is {t.sync_every})"
            )
        if t.sync_every > t.max_staleness + 1:
            raise ValueError(
                f"train.sync_every ({t.sync_every}) needs train.max_staleness >= {t.sync_every - 1} "
                f"(it is {t.max_staleness:g}): between syncs vLLM samples with weights up to "
                f"sync_every - 1 steps old; raise max_staleness or lower sync_every"
            )
        k, high = t.in_flight_groups(), t.train_batch_size * (t.whole_staleness() + 1)
        if not t.train_batch_size <= k <= high:
            raise ValueError(
                f"train.max_in_flight_groups ({k}) must be between train.train_batch_size "
                f"({t.train_batch_size}) and train_batch_size * (max_staleness + 1) ({high}): fewer "
                "cannot fill a step, more can never be admitted under the staleness bound"
            )
        if t.loss.corrects and t.old_logprobs == "inference":
            raise ValueError(
                "train.loss.tis_cap / mask_low / mask_high have no effect with train.old_logprobs = "
                "'inference' (the ratio's old log-probs are then the sampler's own, so every "
                "importance ratio is 1): set train.old_logprobs = 'trainer', or leave them unset"
            )
        tr = self.trainer
        if tr.zero_stage is not None and tr.backend != "deepspeed":
            raise ValueError(
                f"trainer.zero_stage applies to trainer.backend = 'deepspeed' only (backend is {tr.backend!r}); "
                "remove it or set trainer.backend = 'deepspeed'"
            )
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"envs names repeat: {names}; give each environment once")
        return self


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (or nothing), apply ``a.b=value`` overrides, validate."""
    data: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for item in overrides:
        apply_override(data, item)
    return validate_config(data, source)


def resolve_config(config: str | Path | dict, overrides: Sequence[str] = ()) -> RunConfig:
    """A config path or dict (a deployment's parameter), with overrides applied, validated."""
    if isinstance(config, dict):
        data = copy.deepcopy(config)
        for item in overrides:
            apply_override(data, item)
        return validate_config(data, "config parameter")
    return load_config(config, list(overrides))


UNSET_VALUES = ("none", "null")


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in ``data``; value is parsed as TOML, else kept as a string.

    ``~a.b.c`` and ``a.b.c=none`` (or ``null``) remove the key, so it takes its default (a
    section such as ``model.tiny`` is then unset): the way to switch the quickstart to
    ``model.path`` from the command line. A string "none" is written ``a.b.c='"none"'``.
    """
    item = item.strip()
    if item.startswith("~"):
        key, raw, unset = item[1:], "", True
        if "=" in key:
            raise ConfigError(f"override {item!r}: ~key removes a key and takes no value")
    else:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(
                f"override {item!r} is not of the form key.path=value (or ~key.path to remove it)"
            )
        unset = raw.strip().lower() in UNSET_VALUES
    if not key.strip():
        raise ConfigError(f"override {item!r} names no key")
    *parents, leaf = key.strip().split(".")
    if unset:
        _remove(data, parents, leaf, item)
        return
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def _remove(data: dict[str, Any], parents: list[str], leaf: str, item: str) -> None:
    """Remove ``parents.leaf`` if present; a key the config tree does not know is an error."""
    known = _known_keys(parents)
    if leaf not in known:
        suggestion = _suggest(parents, leaf, known)
        path = ".".join([*parents, leaf])
        raise ConfigError(
            f"override {item!r}: unknown key {path!r}{suggestion} "
            f"(known: {', '.join(sorted(known)) or 'none'})"
        )
    node: Any = data
    for part in parents:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return
    if isinstance(node, dict):
        node.pop(leaf, None)


def validate_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a raw dict; errors name the offending key path and the fix."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config\n" + _explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            *parent, leaf = [str(p) for p in err["loc"]]
            known = _known_keys(parent)
            suggestion = _suggest(parent, leaf, known)
            lines.append(f"  unknown key {loc!r}{suggestion} (known: {', '.join(sorted(known))})")
        else:
            lines.append(f"  {loc or '<root>'}: {err['msg']}")
    return "\n".join(lines)


def _suggest(parent: list[str], leaf: str, known: list[str]) -> str:
    """The closest known key, also one section down (``train.kl_coef`` -> ``train.loss.kl_coef``)."""
    nested = {f"{key}.{sub}": sub for key in known for sub in _known_keys([*parent, key])}
    by_leaf = {key: key for key in known} | {sub: path for path, sub in nested.items()}
    hint = difflib.get_close_matches(leaf, list(by_leaf), n=1)
    return f"; did you mean {'.'.join([*parent, by_leaf[hint[0]]])!r}?" if hint else ""


def _known_keys(parent: list[str]) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in parent:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return cfg.model_dump(mode="json")
