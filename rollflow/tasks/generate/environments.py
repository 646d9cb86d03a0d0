"""Environments: a prompt dataset plus an async rollout of one group.

An environment gives prompts (with a reference answer for the held-out split and the
supervised warm start) and turns one prompt into a group of scored samples. Single-turn
environments only write ``reward``; a multi-turn environment overrides ``rollout_group`` and
calls ``ctx.sample`` as many times as it needs.

Reward functions run in a worker thread, off the producer's event loop. A reward function that
raises marks that sample with an ``error`` (and a NaN reward) instead of failing the step.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollflow.infra.errors import ConfigError
from rollflow.tasks.generate.reward_fns import RewardFns, load_reward_fns

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of an environment; ``answer`` is the reference completion.

    ``messages`` (OpenAI-style chat messages) makes it a chat prompt, rendered by the model's
    chat template (``chat.py``); ``text`` is then what the rollout rows show (e.g. the user's
    question). ``tools`` are JSON-schema function specs the template lists for the model.
    """

    env: str
    prompt_id: str
    text: str
    answer: str
    messages: tuple[dict[str, Any], ...] | None = field(default=None, hash=False, compare=False)
    tools: tuple[dict[str, Any], ...] | None = field(default=None, hash=False, compare=False)
    # The example's other columns (metadata), given to plain reward functions (reward_fns.py).
    fields: dict[str, Any] | None = field(default=None, hash=False, compare=False)


@dataclass
class Sample:
    """One scored rollout of a prompt.

    A multi-turn episode sets the turn fields (see ``infra/schema.py``): ``completion_mask``
    (1: the model's token, 0: the environment's), ``turn_offsets`` / ``turn_roles`` /
    ``turn_versions`` per turn, ``stop_reason`` and ``truncated``. Left unset, the sample is
    one model turn: every token trained, stopped for ``finish_reason``.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_text: str
    finish_reason: str
    reward: float = math.nan
    error: str | None = None
    generate_s: float = 0.0
    reward_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    completion_mask: list[int] | None = None
    turn_offsets: list[int] | None = None
    turn_roles: list[str] | None = None
    turn_versions: list[float] | None = None
    stop_reason: str | None = None
    truncated: bool | None = None

    def turn_columns(self, version_started: float) -> dict[str, Any]:
        """The schema's multi-turn columns of this sample (single-turn defaults filled in)."""
        n = len(self.completion_ids)
        roles = self.turn_roles or (["assistant"] if n else [])
        stop = self.stop_reason or self.finish_reason
        return {
            "completion_mask": self.completion_mask
            if self.completion_mask is not None
            else [1] * n,
            "turn_offsets": self.turn_offsets
            if self.turn_offsets is not None
            else [0] * len(roles),
            "turn_roles": roles,
            "turn_versions": self.turn_versions or [version_started] * len(roles),
            "num_turns": sum(r == "assistant" for r in roles),
            "stop_reason": stop,
            "truncated": self.truncated if self.truncated is not None else stop == "length",
        }


@dataclass
class RolloutContext:
    """What a rollout may use: a sampling call (with retries) and the tokenizer.

    ``render`` turns a prompt into token ids (chat template for message prompts, see
    ``chat.PromptRenderer``); without one, prompts are raw text through ``encode``.
    ``renderer`` is the ``PromptRenderer`` itself, for multi-turn envs that append turns;
    ``policy_version()`` the version vLLM holds now (the rollout producer's; None elsewhere);
    ``max_tokens`` the longest model turn (``sampling.max_tokens``).
    """

    sample: Callable[..., Awaitable[list[Any]]]  # (prompt_ids, n=...) -> list[Completion]
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_token_id: int | None
    render: Callable[[Prompt], list[int]] | None = None
    renderer: Any = None
    stop_token_ids: tuple[int, ...] = ()
    policy_version: Callable[[], float | None] = lambda: None
    max_tokens: int | None = None

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids of ``prompt`` as vLLM gets them."""
        if self.render is not None:
            return self.render(prompt)
        if prompt.messages is not None:
            raise ValueError(
                f"env {prompt.env}: a chat prompt needs a rollout context with a renderer"
            )
        return self.encode(prompt.text)

    def is_stop(self, token_id: int) -> bool:
        return token_id == self.eos_token_id or token_id in self.stop_token_ids


class Environment(ABC):
    """A prompt dataset and a rollout of one group of samples for a prompt."""

    name: str = "env"
    # "individual": each sample scored alone, a failed sample is dropped and its group kept.
    # "group": samples scored against each other, a failed sample drops the whole group.
    scoring: Literal["individual", "group"] = "individual"
    # Rows of the env's dataset skipped as malformed (0 for generated prompts); read by the
    # generate task so that the count reaches the step's result and metrics.
    num_skipped_rows: int = 0

    def limit_prompt_length(self, prompt_len: Callable[[Prompt], int], max_len: int) -> int:
        """Drop the prompts longer than ``max_len`` tokens (``[prompt] max_prompt_length``),
        counted in ``num_skipped_rows``; returns how many. Envs with a finite prompt set
        (``DatasetEnv``) override it; generated prompts are left as they are."""
        return 0

    @abstractmethod
    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        """``count`` prompts of ``split``; the train and eval splits never share a prompt.

        An env with a finite held-out set may return fewer eval prompts than ``count``.
        """

    @abstractmethod
    async def rollout_group(
        self, prompt: Prompt, group_size: int, ctx: RolloutContext
    ) -> list[Sample]:
        """Sample and score ``group_size`` rollouts of ``prompt``."""


class SingleTurnEnv(Environment):
    """One completion per rollout, scored by ``reward(prompt, completion_text)``, or by the plain
    functions of ``[[envs]] rewards`` when ``reward_fns`` is set (``reward_fns.py``)."""

    reward_fns: RewardFns | None = None

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score one completion (runs in a worker thread)."""

    async def rollout_group(
        self, prompt: Prompt, group_size: int, ctx: RolloutContext
    ) -> list[Sample]:
        # Tokenising, detokenising and scoring run in a worker thread, off the producer's loop.
        prompt_ids = await asyncio.to_thread(ctx.prompt_ids, prompt)
        start = time.perf_counter()
        completions = await ctx.sample(prompt_ids, n=group_size)
        generate_s = time.perf_counter() - start
        samples = [
            Sample(
                prompt_ids=prompt_ids,
                completion_ids=list(c.token_ids),
                completion_logprobs=list(c.logprobs),
                completion_text="",
                finish_reason=c.finish_reason,
                generate_s=generate_s,
            )
            for c in completions
        ]
        if self.reward_fns is None:
            await asyncio.to_thread(self._decode_and_score, prompt, samples, ctx)
            return samples
        await asyncio.to_thread(self._decode, samples, ctx)
        start = time.perf_counter()
        scored = await self.reward_fns.score(prompt, [s.completion_text for s in samples])
        reward_s = (time.perf_counter() - start) / max(len(samples), 1)
        for s, result in zip(samples, scored, strict=True):
            s.reward_s = reward_s
            if isinstance(result, str):
                s.error = result
            else:
                s.reward, s.info["rewards"] = result
        return samples

    def _decode(self, samples: list[Sample], ctx: RolloutContext) -> None:
        for s in samples:
            ids = s.completion_ids
            s.completion_text = ctx.decode(ids[:-1] if ids and ctx.is_stop(ids[-1]) else ids)

    def _decode_and_score(self, prompt: Prompt, samples: list[Sample], ctx: RolloutContext) -> None:
        self._decode(samples, ctx)
        for s in samples:
            start = time.perf_counter()
            try:
                s.reward = float(self.reward(prompt, s.completion_text))
                if not math.isfinite(s.reward):
                    raise ValueError(f"reward is {s.reward}")
            except Exception as exc:  # a user's reward function may raise anything
                s.reward, s.error = math.nan, f"reward: {type(exc).__name__}: {exc}"
            s.reward_s = time.perf_counter() - start


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """A stable hash split: the same key lands in the same split on every machine."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def pick_indices(split: Split, n: int, count: int, rng: random.Random) -> list[int]:
    """Which of a fixed list of ``n`` items ``prompts`` returns: ``count`` drawn with replacement
    for training, at most ``count`` distinct ones for evaluation."""
    if split == "eval":
        return rng.sample(range(n), min(count, n))
    return [rng.randrange(n) for _ in range(count)]


class _ExactMatchEnv(SingleTurnEnv):
    """Exact match of the stripped completion against the reference answer."""

    eval_fraction = 0.2

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(completion.strip() == prompt.answer)

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        want_eval = split == "eval"
        out: list[Prompt] = []
        if count == 0:  # a batch whose env mix drew none of this env (2^-8 for 2 envs, 8 prompts)
            return out
        for _ in range(count * 1000):
            text, answer = self._draw(rng)
            if in_eval_split(text, self.eval_fraction) == want_eval:
                out.append(Prompt(self.name, f"{self.name}:{text}", text, answer))
                if len(out) == count:
                    return out
        raise RuntimeError(f"env {self.name!r}: could not draw {count} {split} prompts")

    @abstractmethod
    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """One random (prompt text, answer)."""

    def sft_examples(self, count: int, rng: random.Random) -> list[tuple[str, str]]:
        """(prompt, answer) pairs of the train split for a supervised warm start."""
        return [(p.text, p.answer) for p in self.prompts("train", count, rng)]


class AddEnv(_ExactMatchEnv):
    """Small-number addition: ``"12+34="`` → ``"46"``."""

    name = "add"

    def __init__(self, max_value: int = 99):
        if max_value < 1:
            raise ConfigError(f"env add: args.max_value must be >= 1, got {max_value}")
        self.max_value = max_value

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return f"{a}+{b}=", str(a + b)


class SortLettersEnv(_ExactMatchEnv):
    """Letter sorting: ``"sort dcab="`` → ``"abcd"``.

    ``partial_credit``: the reward is the fraction of positions right (over the longer of the
    answer and the completion) instead of exact match, a dense signal for long words that a
    small model rarely gets wholly right.
    """

    name = "sort_letters"

    def __init__(
        self,
        letters: str = "abcdefgh",
        min_len: int = 3,
        max_len: int = 5,
        partial_credit: bool = False,
    ):
        if not 1 <= min_len <= max_len:
            raise ConfigError(
                f"env sort_letters: need 1 <= args.min_len <= args.max_len, got {min_len}, {max_len}"
            )
        self.letters, self.min_len, self.max_len = letters, min_len, max_len
        self.partial_credit = partial_credit

    def reward(self, prompt: Prompt, completion: str) -> float:
        if not self.partial_credit:
            return super().reward(prompt, completion)
        got, want = completion.strip(), prompt.answer
        return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want))

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(
            rng.choice(self.letters) for _ in range(rng.randint(self.min_len, self.max_len))
        )
        return f"sort {word}=", "".join(sorted(word))


class ReverseLettersEnv(_ExactMatchEnv):
    """Word reversal, a string transformation: ``"rev dcab="`` → ``"bacd"``."""

    name = "reverse_letters"

    def __init__(self, letters: str = "abcdefgh", min_len: int = 3, max_len: int = 5):
        if not 1 <= min_len <= max_len:
            raise ConfigError(
                f"env reverse_letters: need 1 <= args.min_len <= args.max_len, got {min_len}, "
                f"{max_len}"
            )
        self.letters, self.min_len, self.max_len = letters, min_len, max_len

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(
            rng.choice(self.letters) for _ in range(rng.randint(self.min_len, self.max_len))
        )
        return f"rev {word}=", word[::-1]


class ShiftLettersEnv(_ExactMatchEnv):
    """A Caesar shift, arithmetic modulo the alphabet: ``"shift 2 hab="`` → ``"bcd"`` over
    ``letters = "abcdefgh"`` (each letter moved ``k`` places, wrapping), ``k`` from 1 to
    ``max_shift``."""

    name = "shift_letters"

    def __init__(
        self, letters: str = "abcdefgh", min_len: int = 3, max_len: int = 5, max_shift: int = 3
    ):
        if not 1 <= min_len <= max_len or not 1 <= max_shift < len(letters):
            raise ConfigError(
                "env shift_letters: need 1 <= args.min_len <= args.max_len and "
                f"1 <= args.max_shift < len(args.letters), got {min_len}, {max_len}, {max_shift}"
            )
        self.letters, self.min_len, self.max_len = letters, min_len, max_len
        self.max_shift = max_shift

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(
            rng.choice(self.letters) for _ in range(rng.randint(self.min_len, self.max_len))
        )
        k, n = rng.randint(1, self.max_shift), len(self.letters)
        shifted = "".join(self.letters[(self.letters.index(c) + k) % n] for c in word)
        return f"shift {k} {word}=", shifted


class ModAddEnv(_ExactMatchEnv):
    """Modular addition: ``"17+9 mod 7="`` → ``"5"``, moduli from ``min_mod`` to ``max_mod``."""

    name = "mod_add"

    def __init__(self, max_value: int = 20, min_mod: int = 3, max_mod: int = 9):
        if max_value < 1 or not 2 <= min_mod <= max_mod:
            raise ConfigError(
                "env mod_add: need args.max_value >= 1 and 2 <= args.min_mod <= args.max_mod, "
                f"got {max_value}, {min_mod}, {max_mod}"
            )
        self.max_value, self.min_mod, self.max_mod = max_value, min_mod, max_mod

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        m = rng.randint(self.min_mod, self.max_mod)
        return f"{a}+{b} mod {m}=", str((a + b) % m)


# Built-in environments by name: import paths, so that an env's dependencies load only when used.
BUILTIN_ENVS: dict[str, str] = {
    "add": "rollflow.tasks.generate.environments:AddEnv",
    "sort_letters": "rollflow.tasks.generate.environments:SortLettersEnv",
    "reverse_letters": "rollflow.tasks.generate.environments:ReverseLettersEnv",
    "mod_add": "rollflow.tasks.generate.environments:ModAddEnv",
    "shift_letters": "rollflow.tasks.generate.environments:ShiftLettersEnv",
    "dataset": "rollflow.tasks.generate.dataset_envs:DatasetEnv",
    "math": "rollflow.tasks.generate.dataset_envs:MathEnv",
    "calculator": "rollflow.tasks.generate.tool_env:ToolEnv",
    "guess_number": "rollflow.tasks.generate.tool_env:GuessNumberEnv",
    "reasoning_gym": "rollflow.tasks.generate.ecosystems:ReasoningGymEnv",
    "verifiers": "rollflow.tasks.generate.verifiers_env:VerifiersEnv",
}


def load_env(
    name: str,
    args: dict[str, Any],
    *,
    rewards: Sequence[Any] = (),
    reward_timeout_s: float = 30.0,
    key: str = "envs",
) -> Environment:
    """A built-in environment by name, or any ``package.module:Class``; ``rewards`` (objects with
    ``fn`` and ``weight``, ``[[envs]] rewards``) replace a single-turn env's own reward."""
    fns = load_reward_fns(rewards, key=f"{key}.rewards") if rewards else None
    if name not in BUILTIN_ENVS and ":" not in name:
        raise ConfigError(
            f"unknown env {name!r} in [[envs]]: use one of {sorted(BUILTIN_ENVS)} or "
            "'package.module:Class'"
        )
    module, _, attr = BUILTIN_ENVS.get(name, name).partition(":")
    try:
        cls: Any = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"env {name!r}: cannot import {attr!r} from {module!r}: {exc}; check the name "
            "(package.module:Class) and that its package is installed"
        ) from exc
    try:
        env = cls(**args)
    except TypeError as exc:
        raise ConfigError(
            f"env {name!r}: bad args {args}: {exc}; fix the args of its [[envs]] table"
        ) from exc
    if not isinstance(env, Environment):
        raise ConfigError(
            f"env {name!r}: {cls!r} is not a rollflow Environment; subclass "
            "rollflow.tasks.generate.environments.Environment"
        )
    if fns is not None:
        if not isinstance(env, SingleTurnEnv):
            raise ConfigError(
                f"{key}.rewards: env {name!r} is not single-turn (a SingleTurnEnv); plain reward "
                "functions score single-turn envs such as 'dataset' and 'math'"
            )
        env.reward_fns = RewardFns(tuple(fns), reward_timeout_s)
    env.name = name  # prompts carry the name the config gave, which keys the run's env mix
    return env
