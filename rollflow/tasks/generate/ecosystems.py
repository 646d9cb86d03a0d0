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
- ``verifiers`` (``VerifiersEnv``): an environment loaded by ``verifiers.load_environment(id,
  **args)``. Its dataset gives the prompts (``prompt`` messages, or ``question`` plus the env's
  ``system_prompt``), its ``oai_tools`` the tools, its ``env_response`` the environment turns
  of a multi-turn env (a ``SingleTurnEnv`` has none), its rubric the reward
  (``rubric.score_rollout``). rollflow drives the turns itself, so that the tokens are the
  model's own; verifiers' own rollout loop (an OpenAI client and its stop conditions beyond
  ``final_env_response``) is not used.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import random
import re
from typing import Any

from rollflow.tasks.generate.environments import Prompt, SingleTurnEnv, Split, in_eval_split
from rollflow.tasks.generate.multi_turn import EnvReply, MultiTurnEnv

EVAL_SEED_OFFSET = 1_000_003


def _import(module: str, pip_name: str, env: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(
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
        rg = _import("reasoning_gym", "reasoning-gym", "reasoning_gym")
        try:
            self.train_data = rg.create_dataset(dataset, seed=seed, size=size, **(config or {}))
            held = rg.create_dataset(
                dataset, seed=seed + EVAL_SEED_OFFSET, size=eval_size, **(config or {})
            )
        except Exception as exc:  # an unknown name or a bad config: say which
            raise ValueError(f"env reasoning_gym: dataset {dataset!r}: {exc}") from exc
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
            raise ValueError(
                f"env reasoning_gym: dataset {dataset!r} leaves no training or held-out questions"
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
        if split == "eval":
            return [self._prompt(split, i) for i in rng.sample(range(n), min(count, n))]
        return [self._prompt(split, rng.randrange(n)) for _ in range(count)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        _, split, index = prompt.prompt_id.rsplit(":", 2)
        entry = self._entries[split][int(index)]
        answer = _extract(completion, self.answer_tag)
        return float(self._scorer[split].score_answer(answer=answer, entry=entry))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class VerifiersEnv(MultiTurnEnv):
    """A verifiers environment's dataset, protocol and rubric, driven by rollflow's turns."""

    name = "verifiers"

    def __init__(
        self,
        env_id: str,
        env_args: dict[str, Any] | None = None,
        max_turns: int = 8,
        max_total_tokens: int = 1024,
        eval_fraction: float = 0.1,
    ):
        super().__init__(max_turns, max_total_tokens)
        vf = _import("verifiers", "verifiers", "verifiers")
        try:
            self.vf_env = vf.load_environment(env_id, **(env_args or {}))
        except Exception as exc:
            raise ValueError(f"env verifiers: cannot load environment {env_id!r}: {exc}") from exc
        self.env_id = env_id
        self.single_turn = isinstance(self.vf_env, getattr(vf, "SingleTurnEnv", ()))
        self.tools = tuple(getattr(self.vf_env, "oai_tools", None) or ()) or None
        train = _rows(_dataset(self.vf_env, "train"))
        held = _rows(_dataset(self.vf_env, "eval"))
        if not held:  # no eval dataset: a stable hash split of the training rows
            held = [r for r in train if in_eval_split(_key(r), eval_fraction)]
            train = [r for r in train if not in_eval_split(_key(r), eval_fraction)]
        if not train or not held:
            raise ValueError(
                f"env verifiers: {env_id!r} gives {len(train)} training and {len(held)} "
                "held-out rows; both need at least one"
            )
        self._rows: dict[Split, list[dict]] = {"train": train, "eval": held}

    def _prompt(self, split: Split, i: int) -> Prompt:
        row = self._rows[split][i]
        messages = row.get("prompt")
        if not messages:
            messages = [{"role": "user", "content": row["question"]}]
            system = getattr(self.vf_env, "system_prompt", None)
            if system:
                messages.insert(0, {"role": "system", "content": system})
        text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return Prompt(
            self.name,
            f"{self.env_id}:{split}:{i}",
            str(text),
            str(row.get("answer", "")),
            tuple(dict(m) for m in messages),
            self.tools,
        )

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        n = len(self._rows[split])
        if split == "eval":
            return [self._prompt(split, i) for i in rng.sample(range(n), min(count, n))]
        return [self._prompt(split, rng.randrange(n)) for _ in range(count)]

    def start(self, prompt: Prompt) -> dict[str, Any]:
        _, split, index = prompt.prompt_id.rsplit(":", 2)
        row = self._rows[split][int(index)]
        return {
            "prompt": [dict(m) for m in prompt.messages or ()],
            "completion": [],
            "answer": row.get("answer", ""),
            "info": row.get("info") or {},
            "task": row.get("task", "default"),
            "trajectory": [],
            "responses": [],
            "turn": 0,
        }

    def respond(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> EnvReply:
        state["completion"].append({"role": "assistant", "content": assistant_text})
        state["turn"] += 1
        if self.single_turn:
            return EnvReply(done=True)
        return asyncio.run(self._respond(state))

    async def _respond(self, state: dict[str, Any]) -> EnvReply:
        messages = state["prompt"] + state["completion"]
        if await self._is_completed(messages, state):
            return EnvReply(done=True)
        reply = await _maybe_await(self.vf_env.env_response(messages, state))
        if isinstance(reply, tuple):  # older verifiers: (messages, state)
            reply, new_state = reply
            state.update(new_state or {})
        reply = [reply] if isinstance(reply, dict) else list(reply or [])
        reply = [dict(m) for m in reply]
        state["completion"] += reply
        if state.get("final_env_response") is not None:
            return EnvReply(done=True)
        return EnvReply(reply, done=not reply)

    async def _is_completed(self, messages: list[dict], state: dict[str, Any]) -> bool:
        check = getattr(self.vf_env, "is_completed", None)
        if check is None:
            return False
        params = inspect.signature(check).parameters
        args = (messages, state) if "messages" in params else (state,)
        try:
            return bool(await _maybe_await(check(*args)))
        except (KeyError, TypeError, AttributeError):
            return False  # a newer stop condition reading state rollflow does not keep

    def score(self, prompt: Prompt, state: dict[str, Any]) -> float:
        return asyncio.run(self._score(state))

    async def _score(self, state: dict[str, Any]) -> float:
        rubric = self.vf_env.rubric
        params = inspect.signature(rubric.score_rollout).parameters
        if "prompt" in params:  # older verifiers: (prompt, completion, answer, state, ...)
            kwargs = {k: state[k] for k in ("task", "info") if k in params}
            score = await _maybe_await(
                rubric.score_rollout(
                    state["prompt"], state["completion"], state["answer"], state, **kwargs
                )
            )
            return float(getattr(score, "reward", score))
        await _maybe_await(rubric.score_rollout(state))
        return float(state["reward"])


def _dataset(env: Any, split: Split) -> Any:
    getter = getattr(env, "get_dataset" if split == "train" else "get_eval_dataset", None)
    if getter is not None:
        try:
            return getter()
        except Exception:  # noqa: BLE001 - absent split: fall back to the attribute
            pass
    return getattr(env, "dataset" if split == "train" else "eval_dataset", None)


def _rows(dataset: Any) -> list[dict]:
    if dataset is None:
        return []
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    for row in rows:
        if isinstance(row.get("info"), str):
            try:
                row["info"] = json.loads(row["info"])
            except json.JSONDecodeError:
                pass
    return rows


def _key(row: dict) -> str:
    return json.dumps(row.get("prompt") or row.get("question"), sort_keys=True, default=str)
