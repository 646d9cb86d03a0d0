"""Plain reward functions ([[envs]] rewards): call forms, weights, errors, config-time checks."""

import asyncio
import json
import math
import random
import textwrap
from types import SimpleNamespace

import pytest

from rollflow.flows.preflight import Preflight
from rollflow.infra.config import validate_config
from rollflow.infra.errors import ConfigError
from rollflow.infra.metric_names import Metric
from rollflow.tasks.generate.environments import Prompt, RolloutContext, load_env
from rollflow.tasks.generate.generate_task import _summary
from rollflow.tasks.generate.quarantine import EnvQuarantine, group_error
from rollflow.tasks.generate.rollouts import to_rows

REWARDS_PY = """
import asyncio, time

def accuracy(prompt, completion, answer, **kwargs):
    return float(completion.strip() == answer)

def uses_level(completion, level):
    return {"easy": 0.5, "hard": 2.0}[level]

async def is_short(completion):
    await asyncio.sleep(0)
    return len(completion) < 3

def trl_accuracy(prompts, completions, answer, **kwargs):
    # TRL's batched form, conversational or not
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t == a) for t, a in zip(texts, answer)]

def boom(completion):
    if completion == "boom":
        raise ZeroDivisionError("user bug")
    return 1.0

def hang(completion):
    time.sleep(5)
    return 1.0

async def hang_async(completion):
    await asyncio.sleep(5)
    return 1.0

def nan(completion):
    return float("nan")

def text(completion):
    return "1.0"

def short_list(prompts, completions):
    return [1.0]

not_callable = 3

def no_completion(prompt):
    return 1.0
"""


@pytest.fixture
def rewards_py(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS_PY))
    monkeypatch.chdir(tmp_path)  # a relative file path resolves against where the run starts
    return tmp_path / "rewards.py"


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"q{i}", "answer": "42", "level": "easy"} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _env(data, *fns, timeout_s=30.0):
    specs = [SimpleNamespace(fn=f"rewards.py:{fn}", weight=w) for fn, w in fns]
    return load_env("dataset", {"path": data}, rewards=specs, reward_timeout_s=timeout_s)


def _roll(env, completions, prompt=None):
    by_id = {10 + i: text for i, text in enumerate(completions)}
    outs = [
        SimpleNamespace(token_ids=[10 + i], logprobs=[-0.1], finish_reason="stop")
        for i in range(len(completions))
    ]

    async def sample(prompt_ids, n):
        return outs[:n]

    ctx = RolloutContext(
        sample=sample,
        encode=lambda t: [1],
        eos_token_id=2,
        decode=lambda ids: by_id[ids[0]],
        render=lambda p: [1],
    )
    prompt = prompt or env.prompts("train", 1, random.Random(0))[0]
    return prompt, asyncio.run(env.rollout_group(prompt, len(completions), ctx))


def test_weighted_sum_of_per_sample_functions_with_answer_and_metadata(rewards_py, data):
    env = _env(data, ("accuracy", 1.0), ("uses_level", 2.0), ("is_short", 0.5))
    _, samples = _roll(env, ["42", "nope"])
    assert [s.error for s in samples] == [None, None]
    assert samples[0].reward == 1.0 + 2 * 0.5 + 0.5 * 1.0
    assert samples[1].reward == 0.0 + 2 * 0.5 + 0.0
    assert samples[0].info["rewards"] == {"accuracy": 1.0, "uses_level": 0.5, "is_short": 1.0}


def test_a_trl_batched_function_works_unchanged_on_text_and_chat_prompts(rewards_py, data):
    env = _env(data, ("trl_accuracy", 1.0))
    _, samples = _roll(env, ["42", "41"])
    assert [s.reward for s in samples] == [1.0, 0.0]
    chat = Prompt("dataset", "c", "q", "42", messages=({"role": "user", "content": "q"},))
    _, samples = _roll(env, ["41", "42"], chat)
    assert [s.reward for s in samples] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        ("boom", "reward boom: ZeroDivisionError: user bug"),
        ("hang", "reward hang: TimeoutError: no value within reward_timeout_s = 0.2"),
        ("hang_async", "reward hang_async: TimeoutError"),
        ("nan", "reward nan: returned nan"),
        ("text", "reward text: returned '1.0', not a number"),
        ("short_list", "reward short_list: ValueError: returned [1.0], not a list of 2 numbers"),
    ],
)
def test_a_failing_function_gives_error_rows_that_the_quarantine_counts(
    rewards_py, data, fn, error
):
    env = _env(data, ("accuracy", 1.0), (fn, 1.0), timeout_s=0.2)
    prompt, samples = _roll(env, ["boom", "boom"])
    assert all(math.isnan(s.reward) and s.error.startswith(error) for s in samples)
    assert group_error(samples) == (True, samples[0].error)
    quarantine = EnvQuarantine(after=1, probe_every_s=60, clock=lambda: 0.0)
    quarantine.record("dataset", samples)
    assert quarantine.quarantined() == ["dataset"]
    rows = to_rows("r", 1, [prompt], [samples], 2, [(0, 0)])
    assert [r["error"] for r in rows] == [s.error for s in samples]


def test_each_functions_mean_is_a_metric_per_env(rewards_py, data):
    from rollflow.flows.step_metrics import StepMetrics
    from rollflow.tasks.generate.generate_task import Rollouts

    env = _env(data, ("accuracy", 1.0), ("uses_level", 1.0))
    prompt, samples = _roll(env, ["42", "41"])
    summary = _summary(to_rows("r", 1, [prompt], [samples], 2, [(0, 0)]))
    assert summary["reward_fns"] == {"dataset/accuracy": 0.5, "dataset/uses_level": 0.5}
    metrics = StepMetrics()
    metrics.record_rollouts(
        Rollouts(**summary, reused=False, num_skipped_rows=0, group_scored_envs=[])
    )
    assert metrics.row[f"{Metric.REWARD_FN}/dataset/accuracy"] == 0.5


def _preflight_problems(tmp_path, data, fn):
    cfg = validate_config(
        {
            "run": {"storage": str(tmp_path / "runs")},
            "model": {"path": "unused"},
            "envs": [{"name": "dataset", "args": {"path": data}, "rewards": [{"fn": fn}]}],
        }
    )
    check = Preflight(cfg)
    check.envs()
    return check.problems


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        ("missing.py:accuracy", "no such file"),
        ("rewards.py:nothing", "rewards.py has no 'nothing'"),
        ("rewards.py:not_callable", "'not_callable' in rewards.py is not callable"),
        ("rewards.py:no_completion", "no_completion(prompt) takes no completion"),
        ("no_such_package.mod:fn", "cannot import module 'no_such_package.mod'"),
    ],
)
def test_preflight_names_the_key_and_file_of_an_unusable_function(
    rewards_py, tmp_path, data, fn, why
):
    (problem,) = _preflight_problems(tmp_path, data, fn)
    assert problem.startswith(f"envs[0].rewards[0].fn = {fn!r}: ") and why in problem


def test_config_refuses_a_reference_without_a_function_and_multi_turn_envs(rewards_py, data):
    with pytest.raises(ValueError, match="names no function"):
        validate_config(
            {"model": {"path": "x"}, "envs": [{"name": "add", "rewards": [{"fn": "x"}]}]}
        )
    with pytest.raises(ConfigError, match="not single-turn"):
        load_env("guess_number", {}, rewards=[SimpleNamespace(fn="rewards.py:boom", weight=1.0)])


def test_a_module_function_and_parquet_metadata_columns(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scores.py").write_text(
        "def by_k(completion, k):\n    return k / 7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a", "b", "c", "d"], "answer": ["1", "2", "3", "4"], "k": [7] * 4})
    pq.write_table(table, path)
    env = load_env(
        "dataset",
        {"path": str(path), "eval_fraction": 0.5},
        rewards=[SimpleNamespace(fn="my_rewards_pkg.scores:by_k", weight=3.0)],
    )
    prompt = env.prompts("train", 1, random.Random(0))[0]
    assert prompt.fields == {"k": 7}
    _, samples = _roll(env, ["x"], prompt)
    assert samples[0].reward == 3.0 and samples[0].info["rewards"] == {"by_k": 1.0}
