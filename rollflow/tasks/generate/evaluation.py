"""Held-out evaluation: which prompts, at which temperature, and what is reported.

Owns: the held-out prompt set of a config (``eval_prompts``: the same prompts at every
evaluation of a run and in ``rollflow eval``), the temperature k samples are drawn at
(``eval_temperature``), and the summary (``summarise``: mean reward and pass@1..k, per env and
overall), with its Parquet files and terminal table. The sampling itself is
``generate_task.evaluate_policy``, which the run's evaluate task and ``rollflow eval``
(``flows/evaluate_model.py``) both call: there is one evaluation.

Invariant: with one sample per prompt (``sampling.eval_samples = 1``) the figures are the run's
held-out reward as it always was: greedy by default, a failed sample scores 0, the overall number
is the mean of the envs' means.
"""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import fmean

import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.infra.config import RunConfig
from rollflow.infra.config.sampling_section import SamplingSection
from rollflow.tasks.generate.environments import Environment, Prompt
from rollflow.tasks.generate.rollouts import GroupResult, select_prompts

OVERALL = "overall"  # the summary's row of all envs (the mean of their means)


@dataclass(frozen=True)
class Evaluation:
    """Held-out figures: the mean over environments and each environment's.

    ``pass_at_k`` maps k (1..samples) to the unbiased pass@k estimate (mean over envs, and per env
    in ``pass_at_k_by_env``); ``rows`` holds one dict per prompt x sample (``ROW_SCHEMA``)."""

    reward: float
    reward_by_env: dict[str, float]
    samples: int = 1
    pass_at_k: dict[int, float] = field(default_factory=dict)
    pass_at_k_by_env: dict[str, dict[int, float]] = field(default_factory=dict)
    num_prompts_by_env: dict[str, int] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list, repr=False)


ROW_SCHEMA = pa.schema(
    [
        ("env", pa.string()),
        # the prompt's place in the evaluation (an env may draw one prompt twice: two places)
        ("prompt_index", pa.int32()),
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("sample", pa.int32()),
        ("completion", pa.string()),
        ("reward", pa.float64()),  # 0 for a failed sample, as the held-out reward counts it
        ("passed", pa.bool_()),  # reward >= sampling.eval_pass_reward
        ("error", pa.string()),
    ]
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021, the
    HumanEval paper): 1 - C(n-c, k) / C(n, k), exact in integers (``math.comb``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_temperature(sampling: SamplingSection, samples: int) -> float:
    """One sample: ``eval_temperature`` (greedy by default). Several: ``eval_temperature`` when it
    is above 0, else the training ``temperature`` (k greedy samples would be one sample k times)."""
    if samples > 1 and sampling.eval_temperature == 0:
        return sampling.temperature
    return sampling.eval_temperature


def eval_prompts(cfg: RunConfig, envs: dict[str, Environment]) -> list[Prompt]:
    """``sampling.num_eval_prompts`` held-out prompts of each env, the same for every call."""
    prompts: list[Prompt] = []
    for i, name in enumerate(sorted(envs)):
        prompts += select_prompts(
            {name: envs[name]},
            {name: 1.0},
            cfg.sampling.num_eval_prompts,
            "eval",
            seed=cfg.run.seed * 7919 + i,
        )
    return prompts


def summarise(
    prompts: list[Prompt], results: list[GroupResult], samples: int, pass_reward: float
) -> Evaluation:
    """The figures of ``samples`` samples per prompt (a failed sample or group scores 0)."""
    rows = []
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        group = result if isinstance(result, list) else []
        for i in range(samples):
            s = group[i] if i < len(group) else None
            error = (s.error if s is not None else str(result)) or None
            ok = s is not None and error is None and not math.isnan(s.reward)
            reward = s.reward if ok else 0.0
            rows.append(
                {
                    "env": prompt.env,
                    "prompt_index": index,
                    "prompt_id": prompt.prompt_id,
                    "prompt": prompt.text,
                    "answer": prompt.answer,
                    "sample": i,
                    "completion": s.completion_text if s is not None else "",
                    "reward": reward,
                    "passed": ok and reward >= pass_reward,
                    "error": error if not ok else None,
                }
            )
    return summarise_rows(rows, samples)


def summarise_rows(rows: list[dict], samples: int) -> Evaluation:
    """Mean reward and pass@1..samples per env, and over envs, of rows of ``ROW_SCHEMA``."""
    rewards: dict[str, list[float]] = defaultdict(list)
    passed: dict[tuple[str, int], int] = defaultdict(int)
    for r in rows:
        rewards[r["env"]].append(r["reward"])
        passed[(r["env"], r["prompt_index"])] += bool(r["passed"])
    per_env = {env: fmean(v) for env, v in sorted(rewards.items())}
    by_env: dict[str, dict[int, float]] = {}
    counts: dict[str, int] = {}
    for env in per_env:
        per_prompt = [c for (e, _), c in passed.items() if e == env]
        counts[env] = len(per_prompt)
        by_env[env] = {
            k: fmean(pass_at_k(samples, c, k) for c in per_prompt) for k in range(1, samples + 1)
        }
    overall = {k: fmean(v[k] for v in by_env.values()) for k in range(1, samples + 1)}
    return Evaluation(
        reward=fmean(per_env.values()) if per_env else float("nan"),
        reward_by_env=per_env,
        samples=samples,
        pass_at_k=overall,
        pass_at_k_by_env=by_env,
        num_prompts_by_env=counts,
        rows=rows,
    )


def summary_table(ev: Evaluation) -> pa.Table:
    """One row per env and one ``overall``: prompts, samples, mean reward, pass@1..k."""
    names = [*ev.reward_by_env, OVERALL]
    columns: dict[str, list] = {
        "env": names,
        "num_prompts": [*ev.num_prompts_by_env.values(), sum(ev.num_prompts_by_env.values())],
        "samples": [ev.samples] * len(names),
        "reward": [*ev.reward_by_env.values(), ev.reward],
    }
    for k in range(1, ev.samples + 1):
        columns[f"pass@{k}"] = [*(v[k] for v in ev.pass_at_k_by_env.values()), ev.pass_at_k[k]]
    return pa.table(columns)


def render_table(ev: Evaluation) -> str:
    """The summary as the terminal shows it: a header, one line per env, then ``overall``."""
    table = summary_table(ev).to_pylist()
    header = list(table[0])
    width = max(len(OVERALL), *(len(r["env"]) for r in table))
    lines = [f"{'env':<{width}} " + " ".join(f"{h:>11}" for h in header[1:])]
    for r in table:
        cells = [f"{r[h]:>11}" if isinstance(r[h], int) else f"{r[h]:>11.4f}" for h in header[1:]]
        lines.append(f"{r['env']:<{width}} " + " ".join(cells))
    return "\n".join(lines)


def parquet_files(ev: Evaluation, about: dict) -> dict[str, bytes]:
    """``samples.parquet`` (``ROW_SCHEMA``, a row per prompt x sample) and ``summary.parquet``
    (``summary_table``), each with ``about`` (what was evaluated) in its metadata."""
    meta = {b"rollflow.eval": json.dumps(about, sort_keys=True).encode()}
    out = {}
    for name, table in (
        ("samples.parquet", pa.Table.from_pylist(ev.rows, schema=ROW_SCHEMA)),
        ("summary.parquet", summary_table(ev)),
    ):
        sink = io.BytesIO()
        pq.write_table(table.replace_schema_metadata(meta), sink)
        out[name] = sink.getvalue()
    return out
