"""The generate stage: rollouts of one step, written to ``rollouts/step=N``; and evaluation.

Resume rule (one rule for every staleness bound): committed rollouts of step N are reused when
every group started from a policy version v with ``N - 1 - max_staleness <= v <= C`` (C: the
checkpoint the run resumed from); otherwise they are removed and generated again.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from functools import lru_cache
from statistics import fmean

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE
from transformers import AutoTokenizer

from rollflow.infra.config import RunConfig
from rollflow.infra.context import RunContext
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.schema import rows_to_table
from rollflow.tasks.generate.environments import Environment, RolloutContext, load_env
from rollflow.tasks.generate.rollouts import (
    GroupResult,
    RetryPolicy,
    Sampler,
    SamplingStats,
    generate_groups,
    select_prompts,
    to_rows,
    train_prompt_seed,
)


@lru_cache(maxsize=4)
def _tokenizer(model_path: str):
    return AutoTokenizer.from_pretrained(model_path)


def build_envs(cfg: RunConfig) -> dict[str, Environment]:
    return {spec.name: load_env(spec.name, spec.args) for spec in cfg.envs}


def _rollout_context(ctx: RunContext, client: InferenceClient, *, temperature: float,
                     stats: SamplingStats) -> RolloutContext:
    tok = _tokenizer(ctx.model_path)
    s, inf = ctx.config.sampling, ctx.config.inference
    sampler = Sampler(client, max_tokens=s.max_tokens, temperature=temperature, top_p=s.top_p,
                      retry=RetryPolicy(), stats=stats, deadline_s=inf.startup_timeout_s + inf.request_timeout_s)
    return RolloutContext(sample=sampler, encode=lambda text: tok(text).input_ids,
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                          eos_token_id=tok.eos_token_id)


def _sample(ctx: RunContext, envs: dict[str, Environment], prompts: list, group_size: int,
            temperature: float) -> tuple[list[GroupResult], SamplingStats]:
    """One group per prompt from the inference deployment, on a short-lived client."""
    stats = SamplingStats()

    async def run():
        client = InferenceClient(ctx.inference.url, timeout_s=ctx.config.inference.request_timeout_s)
        try:
            rctx = _rollout_context(ctx, client, temperature=temperature, stats=stats)
            return await generate_groups(envs, prompts, rctx, group_size, ctx.config.inference.max_concurrency)
        finally:
            await client.aclose()

    return asyncio.run(run()), stats


def reusable_rollouts(ctx: RunContext, step: int, resumed_from: int) -> pa.Table | None:
    """Committed rollouts of ``step`` that may be trained on after resuming from ``resumed_from``."""
    storage = ctx.storage
    if not storage.is_committed("rollouts", step):
        return None
    table = storage.read_step_table("rollouts", step)
    versions = table.column("version_started")
    low = step - 1 - ctx.config.train.max_staleness
    ok = pc.min(versions).as_py() >= low and pc.max(versions).as_py() <= resumed_from
    return table if ok else None


@task(name="generate", cache_policy=NO_CACHE, persist_result=False)
def generate(ctx: RunContext, step: int, version: int, resumed_from: int = -1) -> dict:
    """Sample ``train_batch_size`` groups for ``step`` with policy ``version``; commit them."""
    storage = ctx.storage
    cfg = ctx.config
    envs = build_envs(cfg)
    # Malformed dataset rows are skipped when an env loads; the count travels with every step.
    num_skipped_rows = sum(env.num_skipped_rows for env in envs.values())
    table = reusable_rollouts(ctx, step, resumed_from)
    if table is not None:
        return {**_summary(table.to_pylist()), "reused": True, "generate_s": 0.0,
                "num_skipped_rows": num_skipped_rows}
    storage.remove_step("rollouts", step)
    prompts = select_prompts(envs, {e.name: e.weight for e in cfg.envs}, cfg.train.train_batch_size,
                             "train", seed=train_prompt_seed(cfg.run.seed, step))
    start = time.perf_counter()
    results, stats = _sample(ctx, envs, prompts, cfg.sampling.group_size, cfg.sampling.temperature)
    generate_s = time.perf_counter() - start
    if all(isinstance(r, str) for r in results):
        raise RuntimeError(f"every group of step {step} failed; first error: {results[0]}")
    rows = to_rows(cfg.run.name, step, prompts, results, cfg.sampling.group_size,
                   [(version, version)] * len(prompts))
    storage.write_step_table("rollouts", step, rows_to_table(rows))
    return {**_summary(rows), "reused": False, "generate_s": generate_s, "retries": stats.retries,
            "retry_reasons": dict(stats.retry_reasons), "num_skipped_rows": num_skipped_rows}


def _summary(rows: list[dict]) -> dict:
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    by_env: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["reward"] is not None:
            by_env[r["env"]].append(r["reward"])
    return {
        "num_rollouts": len(rows),
        "num_errors": sum(r["error"] is not None for r in rows),
        "reward_mean": fmean(rewards) if rewards else float("nan"),
        "reward_by_env": {k: fmean(v) for k, v in sorted(by_env.items())},
        "completion_tokens": sum(len(r["completion_ids"]) for r in rows),
    }


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate(ctx: RunContext) -> dict:
    """Held-out reward per environment: a fixed prompt set, sampled at the eval temperature."""
    cfg = ctx.config
    envs = build_envs(cfg)
    s = cfg.sampling
    prompts = []
    for i, name in enumerate(sorted(envs)):
        prompts += select_prompts({name: envs[name]}, {name: 1.0}, s.num_eval_prompts, "eval",
                                  seed=cfg.run.seed * 7919 + i)
    results, _ = _sample(ctx, envs, prompts, 1, s.eval_temperature)
    by_env: dict[str, list[float]] = defaultdict(list)
    for prompt, samples in zip(prompts, results, strict=True):
        ok = isinstance(samples, list) and samples and samples[0].error is None
        by_env[prompt.env].append(samples[0].reward if ok else 0.0)
    per_env = {k: fmean(v) for k, v in sorted(by_env.items())}
    return {"eval_reward": fmean(per_env.values()), "eval_reward_by_env": per_env}
