"""The reasoning-gym and verifiers adapters.

Both packages are optional (the extra ``envs``; the CPU lock installs them, so CI runs the real
ones). Here: the one-line error naming the pip command (the package hidden), the config examples,
and the adapters against stand-ins that implement the packages' public API as the adapters call it
(reasoning-gym: ``create_dataset`` and ``score_answer``; verifiers: ``load_environment``, a
dataset, an async ``env_response`` and a rubric's ``score_rollout(state)``), which pin the
protocol whatever version is installed. The ``real_*`` tests run the installed package;
``tests/flows/test_ecosystem_runs.py`` trains a few steps on each.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import types

import pytest
from test_multi_turn import Scripted, _ctx, tok  # noqa: F401  (tok: the tokenizer fixture)

from rollflow.infra.config import load_config
from rollflow.tasks.generate.environments import load_env


def _missing(name: str) -> bool:
    return importlib.util.find_spec(name) is None


def test_a_missing_package_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    with pytest.raises(ValueError, match=r"pip install reasoning-gym"):
        load_env("reasoning_gym", {"dataset": "leg_counting"})


@pytest.mark.parametrize("name", ["reasoning_gym", "verifiers"])
def test_config_examples_load(name):
    cfg = load_config(f"configs/examples/{name}.toml")
    assert cfg.envs[0].name == name and cfg.model.path


class _Counting:
    """A stand-in procedural dataset: "How many legs have N cats?" with its own scorer."""

    def __init__(self, seed, size):
        rng = random.Random(seed)
        self.entries = []
        for _ in range(size):
            n = rng.randint(1, 30)
            self.entries.append(
                {"question": f"How many legs have {n} cats?", "answer": str(4 * n), "metadata": {}}
            )

    def __iter__(self):
        return iter(self.entries)

    def score_answer(self, answer, entry):
        return 1.0 if answer == entry["answer"] else 0.01


@pytest.fixture
def fake_reasoning_gym(monkeypatch):
    module = types.ModuleType("reasoning_gym")
    module.create_dataset = lambda name, seed, size, **cfg: _Counting(seed, size)
    monkeypatch.setitem(sys.modules, "reasoning_gym", module)


def test_reasoning_gym_adapter(fake_reasoning_gym, tok):  # noqa: F811
    env = load_env(
        "reasoning_gym",
        {"dataset": "counting", "size": 40, "eval_size": 10, "answer_tag": "answer"},
    )
    held = env.prompts("eval", 100, random.Random(0))
    train = env.prompts("train", 16, random.Random(1))
    assert len(held) == 10 and not {p.text for p in held} & {p.text for p in train}
    prompt = train[0]
    assert prompt.messages[-1] == {"role": "user", "content": prompt.text}
    assert env.reward(prompt, f"so <answer>{prompt.answer}</answer>") == 1.0
    assert env.reward(prompt, prompt.answer) == 0.01  # no tag: the task's own partial score
    model = Scripted(tok, [f"<answer>{prompt.answer}</answer>"] * 2)
    samples = asyncio.run(env.rollout_group(prompt, 2, _ctx(tok, model)))
    assert [s.reward for s in samples] == [1.0, 1.0]


class _VfRubric:
    async def score_rollout(self, state):
        last = state["completion"][-1]["content"] if state["completion"] else ""
        state["reward"] = float(state["answer"] in last)


class _VfDoubleCheck:
    """A stand-in multi-turn verifiers env: asks "Are you sure?" once, then ends."""

    def __init__(self):
        self.dataset = [
            {"question": f"What is {i}+{i}?", "answer": str(2 * i), "info": "{}", "task": "t"}
            for i in range(40)
        ]
        self.eval_dataset = None
        self.system_prompt = "Answer with a number."
        self.rubric = _VfRubric()

    async def env_response(self, messages, state, **kwargs):
        if state["turn"] >= 2:
            state["final_env_response"] = []
            return []
        return [{"role": "user", "content": "Are you sure?"}]


@pytest.fixture
def fake_verifiers(monkeypatch):
    module = types.ModuleType("verifiers")
    module.load_environment = lambda env_id, **kw: _VfDoubleCheck()
    monkeypatch.setitem(sys.modules, "verifiers", module)


def test_verifiers_adapter_runs_the_protocol_with_masked_env_turns(fake_verifiers, tok):  # noqa: F811
    env = load_env("verifiers", {"env_id": "doublecheck", "max_turns": 4, "max_total_tokens": 512})
    train = env.prompts("train", 4, random.Random(0))
    held = env.prompts("eval", 100, random.Random(0))
    assert held and not {p.prompt_id.split(":")[-1] for p in held} & set()
    prompt = train[0]
    assert prompt.messages[0] == {"role": "system", "content": "Answer with a number."}
    model = Scripted(tok, ["0", prompt.answer])
    s = asyncio.run(env.episode(prompt, _ctx(tok, model)))
    assert s.turn_roles == ["assistant", "user", "assistant"] and s.stop_reason == "env_done"
    assert s.reward == 1.0
    env_span = range(s.turn_offsets[1], s.turn_offsets[2])
    assert all(s.completion_mask[i] == 0 for i in env_span)
    assert "Are you sure?" in tok.decode(s.completion_ids[s.turn_offsets[1] : s.turn_offsets[2]])


@pytest.mark.skipif(_missing("reasoning_gym"), reason="reasoning-gym is not installed")
def test_real_reasoning_gym_task_scores_its_own_answers():
    env = load_env("reasoning_gym", {"dataset": "leg_counting", "size": 20, "eval_size": 5})
    prompt = env.prompts("train", 1, random.Random(0))[0]
    assert env.reward(prompt, prompt.answer) == 1.0
