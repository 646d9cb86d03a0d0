"""The reasoning-gym and verifiers adapters.

Both packages are optional (the extra ``envs``; the CPU lock installs them, so CI runs the real
ones). Here: the one-line error naming the pip command (the package hidden), the config examples,
and the adapters against stand-ins that implement the packages' public API as the adapters call it
(reasoning-gym: ``create_dataset`` and ``score_answer``), which pins the protocol whatever
version is installed, and the real ones: reasoning-gym's ``real_*`` test, and verifiers 0.4 with
the tiny taskset and env of ``tests/vf_tiny_env.py`` (importing ``verifiers.v1`` takes
~2 s, cheaper than a stand-in of its Task/Trace/Env API). ``tests/integration/flows/test_multi_turn_run.py``
trains a few steps on each.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import types
from pathlib import Path

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


@pytest.fixture
def tiny_verifiers(monkeypatch):
    """tests/vf_tiny_env.py importable: the taskset id ``vf-tiny-env`` (real verifiers)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))


def _tiny(**args):
    return load_env(
        "verifiers",
        {"taskset": "vf-tiny-env", "max_turns": 4, "max_total_tokens": 512, **args},
    )


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_adapter_plays_the_env_turns_masked_and_scores_with_the_tasks_reward(
    tiny_verifiers,
    tok,  # noqa: F811
):
    env = _tiny()
    train = env.prompts("train", 4, random.Random(0))
    held = env.prompts("eval", 100, random.Random(0))
    assert held and not {p.text for p in held} & {t.data.prompt for t in env._tasks_of["train"]}
    prompt = train[0]
    assert prompt.messages == (
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": prompt.text},
    )
    model = Scripted(tok, ["0", prompt.answer])
    s = asyncio.run(env.episode(prompt, _ctx(tok, model)))
    assert s.turn_roles == ["assistant", "user", "assistant"] and s.stop_reason == "env_done"
    assert s.reward == 1.0 and s.error is None  # the task's @vf.reward reads the last reply
    env_span = range(s.turn_offsets[1], s.turn_offsets[2])
    assert all(s.completion_mask[i] == 0 for i in env_span)
    assert "Are you sure?" in tok.decode(s.completion_ids[s.turn_offsets[1] : s.turn_offsets[2]])


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_held_out_taskset_leaves_its_prompts_out_of_training(tiny_verifiers):
    env = _tiny(num_tasks=20, eval_taskset_args={"size": 5})
    held = {t.data.prompt for t in env._tasks_of["eval"]}
    assert len(held) == 5 and len(env._tasks_of["train"]) == 15
    assert not held & {t.data.prompt for t in env._tasks_of["train"]}


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_single_agent_env_is_one_model_turn(tiny_verifiers, tok):  # noqa: F811
    env = _tiny(env="single-agent")  # verifiers' plain env: Agent.run, one reply
    prompt = env.prompts("train", 1, random.Random(0))[0]
    s = asyncio.run(env.episode(prompt, _ctx(tok, Scripted(tok, [prompt.answer]))))
    assert s.turn_roles == ["assistant"] and s.stop_reason == "env_done" and s.reward == 1.0


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_episode_cut_by_rollflow_ends_the_envs_run_and_is_scored(tiny_verifiers, tok):  # noqa: F811
    env = _tiny(max_turns=1)
    prompt = env.prompts("train", 1, random.Random(0))[0]
    s = asyncio.run(env.episode(prompt, _ctx(tok, Scripted(tok, [prompt.answer]))))
    assert s.stop_reason == "max_turns" and s.reward == 1.0
    # What episode() did, step by step: run() waits in its second turn until score() ends it.
    state = env.start(prompt)
    assert env.respond(prompt, state, "0").messages[0]["content"].startswith("Are you sure?")
    assert env.score(prompt, state) == 0.0
    trace = state["episode"].trace
    assert trace.stop_condition == "max_turns" and trace.metrics == {"turns": 1.0}


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_reply_that_uses_up_the_tokens_is_scored(tiny_verifiers, tok):  # noqa: F811
    """The model's first reply fills max_total_tokens: no env turn follows, and the task's reward
    reads that reply (it is the trace's last, marked sampled)."""
    prompt = _tiny().prompts("train", 1, random.Random(0))[0]
    budget = len(tok(prompt.answer, add_special_tokens=False).input_ids)  # the stop token cut
    env = _tiny(max_total_tokens=budget)
    s = asyncio.run(env.episode(prompt, _ctx(tok, Scripted(tok, [prompt.answer]))))
    assert s.turn_roles == ["assistant"] and s.stop_reason == "max_total_tokens" and s.truncated
    assert s.reward == 1.0 and s.error is None


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
def test_verifiers_env_whose_other_seat_plays_is_refused(tiny_verifiers):
    env = _tiny(env="user-sim")  # a modeled user (untrained, prompt-less) opens the exchange
    prompt = env.prompts("train", 1, random.Random(0))[0]
    with pytest.raises(ValueError, match=r"seat 'user' plays another prompt or untrained"):
        env.respond(prompt, env.start(prompt), "hello")


@pytest.mark.skipif(_missing("verifiers"), reason="verifiers is not installed")
@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"taskset": "no-such-taskset"}, "no-such-taskset"),
        ({"taskset_args": {"sise": 3}}, "taskset.sise"),
        ({"env_args": {"agnet": {}}}, "agnet"),
    ],
)
def test_verifiers_bad_id_or_key_is_named(tiny_verifiers, args, named):
    with pytest.raises(ValueError, match=rf"(?s)env verifiers: cannot load taskset .*{named}"):
        _tiny(**args)


def test_verifiers_missing_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # verifiers < 0.3, or none
    with pytest.raises(ValueError, match=r"pip install 'verifiers>=0.4,<0.5'"):
        load_env("verifiers", {"taskset": "vf-tiny-env"})


@pytest.mark.skipif(_missing("reasoning_gym"), reason="reasoning-gym is not installed")
def test_real_reasoning_gym_task_scores_its_own_answers():
    env = load_env("reasoning_gym", {"dataset": "leg_counting", "size": 20, "eval_size": 5})
    prompt = env.prompts("train", 1, random.Random(0))[0]
    assert env.reward(prompt, prompt.answer) == 1.0
