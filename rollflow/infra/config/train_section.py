"""``[train]``: the algorithm (advantages, loss, mini-batches, epochs, staleness). The processes
that run it are ``[trainer]`` (``trainer_section.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from rollflow.infra.config.base import Section
from rollflow.infra.config.loss import LoraSection, LossConfig
from rollflow.infra.staleness import whole_steps


class TrainSection(Section):
    """The algorithm: GRPO advantages, the policy loss (PPO clip or GSPO), mini-batches and epochs."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    train_batch_size: int = Field(64, ge=1, description="Groups per outer step (one weight sync).")
    mini_batch_size: int = Field(
        None,  # type: ignore[assignment]  # filled in by _one_mini_batch_by_default
        ge=1,
        validate_default=True,
        description="Groups per optimizer step (default: train_batch_size, one optimizer step "
        "per weight sync).",
    )
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
    dynamic_sampling: bool | None = Field(
        None,
        description="DAPO's dynamic sampling: a finished group whose advantages are all zero is "
        "replaced by a newly sampled one before a step takes it, under the same staleness bound "
        "(max_resampled_groups per step, budget left unused carries over): more learning per "
        "optimizer step (0.24-0.57x TRL's steps to a threshold on three tasks), more sampling "
        "per step. Default: on where filter_zero_advantage drops such groups anyway, off where "
        "they are trained.",
    )
    max_resampled_groups: int | None = Field(
        None,
        ge=0,
        description="Dynamic sampling's budget: groups replaced per step at most (default: "
        "train_batch_size, i.e. at most twice the sampling).",
    )
    over_request_steps: int = Field(
        3,
        ge=0,
        description="Dynamic sampling's over-request: each step's first wave admits the groups "
        "that train_batch_size with signal cost (over_request_quantile; at most "
        "max_resampled_groups), p the share of groups without signal over the last this many "
        "steps, so that replacements run "
        "alongside the batch instead of in rounds after it; a step still short replaces serially; "
        "surplus groups stay ready for the next step within max_staleness (at 0 they are "
        "dropped). 0 = off: a replacement starts only once the group it replaces has finished.",
    )
    over_request_quantile: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="Dynamic sampling's over-request, sized so that the first wave holds "
        "train_batch_size groups with signal with this probability (p the share without signal, "
        "each group drawn alike: at train_batch_size 32 and p 0.3, 0.9 asks 20 groups more, 0.5 "
        "about the mean 14), so that few steps fall short and replace serially; lower wastes "
        "fewer groups where max_staleness drops the surplus.",
    )
    truncated: Literal["keep", "drop", "mask", "penalize"] = Field(
        "keep",
        description="Samples cut short (a turn hit max_tokens, an episode its limits): trained as "
        "they are, dropped (DAPO overlong filtering), masked (kept in their group's baseline, left "
        "out of the loss: TRL's mask_truncated_completions) or penalised (DAPO soft overlong "
        "punishment).",
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
        "samples",
        description="How a step's batch becomes its mini-batches: its samples in a seeded random "
        "order (TRL's steps_per_generation), so that each optimizer step sees samples of every "
        "group; or whole groups, in order (an optimizer step then sees only its own few prompts: "
        "1.28x TRL's optimizer steps on reverse_letters, docs/concepts/trl-compatibility.md). "
        "Either way a mini-batch holds mini_batch_size groups' worth of samples.",
    )
    token_mean: Literal["batch", "mini_batch"] = Field(
        "batch",
        description="What an optimizer step's summed token loss is divided by: the loss tokens of "
        "the step's whole batch over its number of mini-batches, the same for every optimizer step "
        "of the step, counting the tokens of the groups that filter_zero_advantage left out (TRL's "
        "loss_type='dapo'; an Adam step shrinks as more groups carry no signal), or the loss "
        "tokens of its own mini-batch (the default before 2026-11-28). The two agree with one "
        "mini-batch per step and nothing filtered.",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up, in optimizer steps."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="The learning rate after warm-up: constant, or decayed linearly or along a "
        "cosine to lr x min_lr_ratio at the run's last optimizer step (run.num_steps x "
        "optimizer steps per step).",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The decay's floor, a fraction of lr (linear and cosine schedules).",
    )

    @field_validator("mini_batch_size", mode="before")
    @classmethod
    def _one_mini_batch_by_default(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A config that sets only train_batch_size gets one optimizer step per weight sync.
        return info.data.get("train_batch_size") if value is None else value

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_kind(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    def resamples(self) -> bool:
        """Whether groups without signal are sampled anew (``dynamic_sampling``; by default
        where ``filter_zero_advantage`` would drop them)."""
        return (
            self.filter_zero_advantage if self.dynamic_sampling is None else self.dynamic_sampling
        )

    def resample_budget(self) -> int:
        """Dynamic sampling's budget: groups replaced per step (``max_resampled_groups``, default
        ``train_batch_size``); what a step leaves unused carries over to the next."""
        return (
            self.train_batch_size
            if self.max_resampled_groups is None
            else self.max_resampled_groups
        )

    def overlong_limit(self, max_tokens: int) -> int:
        """The length whose reward gets the whole overlong penalty: ``overlong_max_tokens``,
        default the sampling's ``max_tokens``."""
        return self.overlong_max_tokens or max_tokens

    def in_flight_groups(self) -> int:
        """K: groups the rollout producer keeps generating at once."""
        return self.max_in_flight_groups or self.train_batch_size * (self.whole_staleness() + 1)

    def optim_steps_per_step(self) -> int:
        """Optimizer steps of a full outer step: mini-batches times epochs."""
        return self.train_batch_size // self.mini_batch_size * self.num_epochs

    def whole_staleness(self) -> int:
        """The whole steps of ``max_staleness``."""
        return whole_steps(self.max_staleness)

    def staleness_bound(self) -> float:
        """``max_staleness`` exactly: its whole steps plus ``sync_lag`` optimizer steps."""
        return self.whole_staleness() + self.sync_lag() / self.optim_steps_per_step()

    def sync_lag(self) -> int:
        """Optimizer steps of ``max_staleness``'s fraction: a step's weights go to vLLM that many
        optimizer steps before its end (0: at its end)."""
        frac = self.max_staleness - self.whole_staleness()
        return max(0, round(frac * self.optim_steps_per_step()))
