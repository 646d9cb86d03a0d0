"""``[[envs]]``, ``[prompt]`` and ``[sampling]``: what is sampled, and how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rollflow.infra.config.base import Section


class RewardSpec(Section):
    """One plain reward function of an env and its weight."""

    fn: str = Field(
        description="`package.module:function` or `path/to/rewards.py:function` (a path relative "
        "to the directory the run starts in)."
    )
    weight: float = Field(1.0, description="Its weight in the env's reward (a weighted sum).")

    @field_validator("fn")
    @classmethod
    def _has_function(cls, fn: str) -> str:
        module, _, name = fn.rpartition(":")
        if not module or not name.isidentifier():
            raise ValueError(
                f"{fn!r} names no function: write 'package.module:function' or "
                "'rewards.py:function'"
            )
        return fn


class EnvSpec(Section):
    """One environment of the mix."""

    name: str = Field(
        description="Built-in name (`sort_letters`, `add`, `reverse_letters`, `shift_letters`, …: "
        "docs/environments.md) or `package.module:Class`."
    )
    weight: float = Field(
        1.0, gt=0, description="Share of the training prompts drawn from this env."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env.")
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Plain reward functions that score this single-turn env's completions instead "
        "of its own reward: the weighted sum of their values (docs/environments.md, 'Your own "
        "reward').",
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Deadline of one call of a reward function; a call past it gives an error row.",
    )


class PromptSection(Section):
    """How prompts become token ids (``tasks/generate/chat.py``)."""

    system: str | None = Field(
        None,
        description="System prompt put first in every chat-formatted prompt, unless the env's "
        "messages start with their own.",
    )
    chat_template: Literal["auto", "messages", "always", "never"] = Field(
        "auto",
        description="When the tokenizer's chat template renders a prompt: 'auto' (every prompt "
        "when the tokenizer has a template, raw text as one user message; none without one), "
        "'messages' (only prompts an env gives as chat messages; raw text goes as it is), "
        "'always' (every prompt; the tokenizer must have a template), 'never' (a base model: raw "
        "text as it is, message prompts refused).",
    )
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        description="Longest prompt, in tokens as vLLM gets them (after the chat template): a "
        "dataset env's longer prompts are dropped when it loads, counted in num_skipped_rows and "
        "warned of, never truncated. None: no limit.",
    )


class SamplingSection(Section):
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
    eval_samples: int = Field(
        1,
        ge=1,
        description="Samples per held-out prompt. 1: one sample at eval_temperature (greedy by "
        "default); k > 1: k samples at eval_temperature, or at temperature when eval_temperature "
        "is 0, and pass@1..k logged (the unbiased estimator of Chen et al. 2021).",
    )
    eval_pass_reward: float = Field(
        1.0,
        description="A held-out sample passes (counts for pass@k) when its reward is at least this.",
    )
    env_quarantine_after: int = Field(
        5,
        ge=0,
        description="Failed groups of one env in a row (nothing to train on: the env raised, or "
        "every sample has an error) after which its prompts are set aside and it is probed; 0: "
        "never.",
    )
    env_probe_every_s: float = Field(
        30.0, gt=0, description="Seconds between probe groups of a quarantined env."
    )
    env_quarantine_give_up_s: float = Field(
        600.0,
        gt=0,
        description="The run fails, naming each env's last error, once every env has been "
        "quarantined this long.",
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
