"""Adapters to the environment ecosystems users already have: reasoning-gym and verifiers.

Both run through rollflow's own machinery: prompts become chat messages rendered by the model's
template, every turn is sampled as token ids with its log-probs through the producer's sampler
(retries, the serving gate, the staleness bound), multi-turn episodes carry the loss mask. Only
the tasks and the scoring come from the ecosystem. Neither package is a dependency of rollflow:
each is imported when an env names it, and a missing one is a one-line error with the pip
command.

- ``reasoning_gym`` (``ReasoningGymEnv``): a procedural dataset (``reasoning_gym.create_dataset``)
  and its own scorer (``dataset.score_answer(answer, entry)``). The held-out split is a second
  dataset with another seed, without the questions of the training one.
- ``verifiers`` (``verifiers_env.VerifiersEnv``): a verifiers 0.4 taskset and env
  (``verifiers.v1``): the tasks' prompts and rewards, the env's turns.
"""

from __future__ import annotations

import importlib
import random
import re
from typing import Any

from rollflow.infra.errors import ConfigError
from rollflow.tasks.generate.environments import Prompt, SingleTurnEnv, Split, pick_indices

EVAL_SEED_OFFSET = 1_000_003


def require(module: str, pip_name: str, env: str) -> Any:
    """``module`` imported, or a one-line error for ``env`` with the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"env {env}: needs the {pip_name} package ({exc}); install it: pip install {pip_name}"
        ) from exc


def _extract(text: str, tag: str | None) -> str:
    """The answer inside ``<tag>...</tag>`` (the last one), or the whole stripped text."""
    if tag:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
        return found[-1].strip() if found else ""
    return text.strip()


class ReasoningGymEnv(SingleTurnEnv):
    """One reasoning-gym task, scored by its own ``score_answer``."""

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        eval_size: int = 100,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        answer_tag: str | None = None,
        instruction: str = "",
    ):
        rg = require("reasoning_gym", "reasoning-gym", "reasoning_gym")
        try:
            self.train_data = rg.create_dataset(dataset, seed=seed, size=size, **(config or {}))
            held = rg.create_dataset(
                dataset, seed=seed + EVAL_SEED_OFFSET, size=eval_size, **(config or {})
            )
        except Exception as exc:  # an unknown name or a bad config: say which
            raise ConfigError(
                f"env reasoning_gym: args.dataset {dataset!r}: {exc}; check the dataset's name "
                "and its args.config"
            ) from exc
        self.dataset, self.answer_tag, self.instruction = dataset, answer_tag, instruction
        held_entries = list(held)
        held_questions = {e["question"] for e in held_entries}
        # The same question in both splits would leak the held-out set into training.
        self._entries: dict[Split, list[dict]] = {
            "train": [e for e in self.train_data if e["question"] not in held_questions],
            "eval": held_entries,
        }
        self._scorer = {"train": self.train_data, "eval": held}
        if not self._entries["train"] or not self._entries["eval"]:
            raise ConfigError(
                f"env reasoning_gym: dataset {dataset!r} leaves no training or held-out questions; "
                "raise args.size / args.eval_size"
            )

    def _prompt(self, split: Split, i: int) -> Prompt:
        entry = self._entries[split][i]
        question = entry["question"] + (f"\n{self.instruction}" if self.instruction else "")
        return Prompt(
            self.name,
            f"{self.dataset}:{split}:{i}",
            entry["question"],
            str(entry["answer"]),
            ({"role": "user", "content": question},),
        )

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        n = len(self._entries[split])
        return [self._prompt(split, i) for i in pick_indices(split, n, count, rng)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        _, split, index = prompt.prompt_id.rsplit(":", 2)
        entry = self._entries[split][int(index)]
        answer = _extract(completion, self.answer_tag)
        return float(self._scorer[split].score_answer(answer=answer, entry=entry))
