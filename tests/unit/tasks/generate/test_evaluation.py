"""Held-out evaluation's figures (evaluation.py): pass@k, the summary, its table and Parquet."""

from __future__ import annotations

import io
import itertools
import json
import math

import pyarrow.parquet as pq
import pytest

from rollflow.infra.config import validate_config
from rollflow.infra.config.sampling_section import SamplingSection
from rollflow.tasks.generate.environments import Prompt, Sample
from rollflow.tasks.generate.evaluation import (
    eval_prompts,
    eval_temperature,
    parquet_files,
    pass_at_k,
    render_table,
    summarise,
)
from rollflow.tasks.generate.generate_task import build_envs


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (c of them passing) that hold a passing one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, n) == 1.0


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def sample(text: str, reward: float, error: str | None = None) -> Sample:
    return Sample([1], [2], [0.0], text, "stop", reward=reward, error=error)


def prompt(env: str, i: int) -> Prompt:
    return Prompt(env, f"{env}:{i}", f"q{i}", f"a{i}")


def test_summary_per_env_overall_and_failures():
    prompts = [prompt("add", 0), prompt("add", 1), prompt("sort", 0)]
    results = [
        [sample("x", 1.0), sample("y", 0.0)],  # one of two passes
        "vLLM answered 500",  # the whole group failed: two rows scoring 0
        [sample("z", 0.5), sample("w", float("nan"), error="reward fn raised")],
    ]
    ev = summarise(prompts, results, samples=2, pass_reward=0.5)
    assert ev.reward_by_env == {"add": 0.25, "sort": 0.25}
    assert ev.reward == 0.25  # the mean of the envs' means
    assert ev.pass_at_k_by_env == {"add": {1: 0.25, 2: 0.5}, "sort": {1: 0.5, 2: 1.0}}
    assert ev.pass_at_k == {1: 0.375, 2: 0.75}
    assert ev.num_prompts_by_env == {"add": 2, "sort": 1}
    assert len(ev.rows) == 6
    failed = [r for r in ev.rows if r["error"]]
    assert [r["error"] for r in failed] == ["vLLM answered 500"] * 2 + ["reward fn raised"]
    assert all(r["reward"] == 0.0 and not r["passed"] for r in failed)


def test_one_greedy_sample_is_the_held_out_reward_as_before():
    prompts = [prompt("add", 0), prompt("add", 1), prompt("sort", 0)]
    ev = summarise(prompts, [[sample("x", 1.0)], [sample("y", 0.0)], "boom"], 1, 1.0)
    assert (ev.reward, ev.reward_by_env) == (0.25, {"add": 0.5, "sort": 0.0})
    assert ev.pass_at_k == {1: 0.25}


def test_k_samples_are_drawn_at_the_training_temperature_when_eval_is_greedy():
    s = SamplingSection(temperature=0.9)
    assert eval_temperature(s, 1) == 0.0
    assert eval_temperature(s, 4) == 0.9
    s = SamplingSection(eval_temperature=0.6)
    assert eval_temperature(s, 4) == 0.6


def test_held_out_prompts_are_the_same_at_every_call():
    cfg = validate_config(
        {
            "model": {"path": "unused"},
            "envs": [{"name": "sort_letters"}, {"name": "add"}],
            "sampling": {"num_eval_prompts": 5},
        }
    )
    first = eval_prompts(cfg, build_envs(cfg))
    assert first == eval_prompts(cfg, build_envs(cfg))
    assert [p.env for p in first] == ["add"] * 5 + ["sort_letters"] * 5


def test_table_and_parquet_files():
    prompts = [prompt("add", 0), prompt("sort_letters", 0)]
    ev = summarise(prompts, [[sample("x", 1.0), sample("y", 0.0)], [sample("z", 0.0)] * 2], 2, 1.0)
    lines = render_table(ev).splitlines()
    assert lines[0].split() == ["env", "num_prompts", "samples", "reward", "pass@1", "pass@2"]
    assert lines[1].split() == ["add", "1", "2", "0.5000", "0.5000", "1.0000"]
    assert lines[2].split() == ["sort_letters", "1", "2", "0.0000", "0.0000", "0.0000"]
    assert lines[3].split() == ["overall", "2", "2", "0.2500", "0.2500", "0.5000"]
    files = parquet_files(ev, {"step": 3, "samples": 2})
    samples = pq.read_table(io.BytesIO(files["samples.parquet"]))
    assert samples.num_rows == 4
    assert samples.column("reward").to_pylist() == [1.0, 0.0, 0.0, 0.0]
    assert samples.column("completion").to_pylist() == ["x", "y", "z", "z"]
    summary = pq.read_table(io.BytesIO(files["summary.parquet"]))
    assert summary.column("env").to_pylist() == ["add", "sort_letters", "overall"]
    assert summary.column("pass@2").to_pylist() == [1.0, 0.0, 0.5]
    about = json.loads(summary.schema.metadata[b"rollflow.eval"])
    assert about == {"samples": 2, "step": 3}
    assert not math.isnan(summary.column("reward").to_pylist()[-1])


def test_a_prompt_drawn_twice_counts_as_two_prompts():
    """An env with few held-out prompts may draw one twice: each draw is a prompt of its own for
    pass@k (its passes are never pooled past k)."""
    twice = [prompt("add", 0), prompt("add", 0)]
    ev = summarise(twice, [[sample("x", 1.0)] * 2, [sample("y", 1.0)] * 2], 2, 1.0)
    assert ev.pass_at_k == {1: 1.0, 2: 1.0} and ev.num_prompts_by_env == {"add": 2}
    assert [r["prompt_index"] for r in ev.rows] == [0, 0, 1, 1]
