"""The generate stage: rollouts of one step, written to ``rollouts/step=N``; and evaluation.

Training rollouts come from the run's rollout producer (``host.py``), which generates ahead of
training under the staleness bound; the generate task takes a step's groups and commits them.

Resume rule (one rule for every staleness bound): committed rollouts of step N are reused when
every group started from a policy version v with ``N - 1 - max_staleness <= v <= C`` (C: the
checkpoint the run resumed from); otherwise they are removed and generated again. Only the
consecutive steps after C that qualify are reused (``reused_steps``): the producer starts after them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import fmean

import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE
from transformers import AutoTokenizer

from rollflow.infra import staleness
from rollflow.infra.config import RunConfig
from rollflow.infra.context import RunContext
from rollflow.infra.schema import loss_mask, rows_to_table
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.pool import InferencePool
from rollflow.tasks.generate.chat import PromptRenderer
from rollflow.tasks.generate.environments import Environment, RolloutContext, load_env
from rollflow.tasks.generate.evaluation import (
    Evaluation,
    eval_prompts,
    eval_temperature,
    summarise,
)
from rollflow.tasks.generate.host import ProducerHost, step_flows_in_flight
from rollflow.tasks.generate.rollouts import (
    RetryPolicy,
    Sampler,
    SamplingStats,
    generate_groups,
    to_rows,
)


@dataclass(frozen=True)
class Rollouts:
    """What the generate task committed for a step (the rows themselves are in storage).

    ``producer`` holds the rollout producer's numbers at the take (staleness, groups in flight,
    loop lag, retries, restarts; empty for reused rollouts)."""

    num_rollouts: int
    num_errors: int
    reward_mean: float
    reward_by_env: dict[str, float]
    completion_tokens: int  # the model's tokens (mask 1); environment tokens are not counted
    reused: bool
    num_skipped_rows: int
    group_scored_envs: list[str]
    producer: dict[str, float] = field(default_factory=dict)
    # Each plain reward function's mean value, keyed "<env>/<function>" ([[envs]] rewards).
    reward_fns: dict[str, float] = field(default_factory=dict)
    # Episodes: environment tokens, model turns per episode, the share cut short, stop reasons.
    turns: dict[str, float] = field(default_factory=dict)
    # The model's tokens per rollout without error (mean, max) and each env's rollouts.
    completion_tokens_mean: float = float("nan")
    completion_tokens_max: int = 0
    rollouts_by_env: dict[str, int] = field(default_factory=dict)


@lru_cache(maxsize=4)
def _tokenizer(model_path: str, revision: str | None = None, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(
        model_path, revision=revision, trust_remote_code=trust_remote_code
    )


def build_envs(cfg: RunConfig, model_path: str | None = None) -> dict[str, Environment]:
    """The run's envs; with ``model_path``, each drops its prompts longer than ``[prompt]
    max_prompt_length`` tokens as that model's tokenizer renders them (counted, never cut)."""
    envs = {
        spec.name: load_env(
            spec.name,
            spec.args,
            rewards=spec.rewards,
            reward_timeout_s=spec.reward_timeout_s,
            key=f"envs[{i}]",
        )
        for i, spec in enumerate(cfg.envs)
    }
    max_len = cfg.prompt.max_prompt_length
    if max_len is not None and model_path is not None:
        tok = _tokenizer(model_path, cfg.model.revision, cfg.model.trust_remote_code)
        render = PromptRenderer(tok, cfg.prompt, model_path)
        for env in envs.values():
            env.limit_prompt_length(lambda prompt: len(render(prompt)), max_len)
    return envs


def make_rollout_context(
    cfg: RunConfig,
    model_path: str,
    client: InferencePool | InferenceClient,
    stats: SamplingStats,
    *,
    temperature: float,
) -> RolloutContext:
    """Sampling with retries plus the policy's tokenizer: what environments need to roll out."""
    tok = _tokenizer(model_path, cfg.model.revision, cfg.model.trust_remote_code)
    s, inf = cfg.sampling, cfg.inference
    sampler = Sampler(
        client,
        max_tokens=s.max_tokens,
        temperature=temperature,
        top_p=s.top_p,
        retry=RetryPolicy(),
        stats=stats,
        deadline_s=inf.startup_timeout_s + inf.request_timeout_s,
    )
    renderer = PromptRenderer(tok, cfg.prompt, model_path)
    return RolloutContext(
        sample=sampler,
        encode=renderer.encode_text,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        eos_token_id=tok.eos_token_id,
        render=renderer,
        renderer=renderer,
        stop_token_ids=tuple(_stop_ids(model_path, cfg.model.revision)),
        max_tokens=s.max_tokens,
    )


def _stop_ids(model_path: str, revision: str | None = None) -> list[int]:
    """Every id vLLM stops on: generation_config.json's eos_token_id (an int or a list)."""
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path, revision=revision).eos_token_id
    except OSError:
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])


def reusable_rollouts(ctx: RunContext, step: int, resumed_from: int) -> bool:
    """Whether the committed rollouts of ``step`` may be trained on after resuming from ``resumed_from``."""
    storage = ctx.storage
    if not storage.is_committed("rollouts", step):
        return False
    versions = storage.read_step_table("rollouts", step).column("version_started")
    low = staleness.oldest_allowed_version(step, ctx.config.train.staleness_bound())
    return pc.min(versions).as_py() >= low and pc.max(versions).as_py() <= resumed_from


def reused_steps(ctx: RunContext, resumed_from: int) -> list[int]:
    """The consecutive steps after the checkpoint whose committed rollouts are reused."""
    steps = []
    for step in range(resumed_from + 1, ctx.config.run.num_steps + 1):
        if not reusable_rollouts(ctx, step, resumed_from):
            break
        steps.append(step)
    return steps


@task(name="generate", cache_policy=NO_CACHE, persist_result=False)
def generate(ctx: RunContext, step: int, host: ProducerHost) -> Rollouts:
    """Take ``train_batch_size`` finished groups for ``step`` from the run's producer (``host``,
    the run flow's); commit them."""
    storage, cfg = ctx.storage, ctx.config
    # Malformed dataset rows are skipped when an env loads; the count travels with every step.
    envs = {
        "num_skipped_rows": sum(env.num_skipped_rows for env in host.envs.values()),
        "group_scored_envs": sorted(n for n, env in host.envs.items() if env.scoring == "group"),
    }
    if host.reuses(step):
        return Rollouts(
            **_summary(storage.read_step_table("rollouts", step).to_pylist()), reused=True, **envs
        )
    # What was derived from this step's old rollouts goes first, so that storage never holds a
    # batch whose rollouts are gone (a run killed here; found by the weight-broadcast fault test).
    for derived in ("batches", "logprobs", "rollouts"):
        storage.remove_step(derived, step)
    start = time.perf_counter()
    groups, producer = host.take(step, take_timeout_s(cfg))
    producer["take_wait_s"] = time.perf_counter() - start
    if all(g.error is not None for g in groups):
        raise RuntimeError(f"every group of step {step} failed; first error: {groups[0].error}")
    rows = to_rows(
        cfg.run.name,
        step,
        [g.prompt for g in groups],
        [g.result for g in groups],
        cfg.sampling.group_size,
        [(g.version_started, g.version_finished) for g in groups],
    )
    storage.write_step_table("rollouts", step, rows_to_table(rows))
    return Rollouts(**_summary(rows), reused=False, producer=producer, **envs)


def take_timeout_s(cfg: RunConfig) -> float:
    """How long a step may wait for its groups: a whole step of every earlier overlapping step."""
    per_step = (
        cfg.inference.request_timeout_s
        + cfg.trainer.request_timeout_s
        + cfg.trainer.weight_sync_timeout_s
    )
    return per_step * step_flows_in_flight(cfg)


def _summary(rows: list[dict]) -> dict:
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    by_env: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["reward"] is not None:
            by_env[r["env"]].append(r["reward"])
    lengths = [sum(loss_mask(r)) for r in rows if r["error"] is None]
    return {
        "num_rollouts": len(rows),
        "num_errors": sum(r["error"] is not None for r in rows),
        "reward_mean": fmean(rewards) if rewards else float("nan"),
        "reward_by_env": {k: fmean(v) for k, v in sorted(by_env.items())},
        "rollouts_by_env": dict(sorted(Counter(r["env"] for r in rows).items())),
        "completion_tokens": sum(sum(loss_mask(r)) for r in rows),
        "completion_tokens_mean": fmean(lengths) if lengths else float("nan"),
        "completion_tokens_max": max(lengths, default=0),
        "turns": _turn_summary(rows),
        "reward_fns": _reward_fn_summary(rows),
    }


def _reward_fn_summary(rows: list[dict]) -> dict[str, float]:
    """Each plain reward function's mean over the step's scored rows, per env."""
    values: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["error"] is None and '"rewards"' in (r.get("info") or ""):
            for name, v in json.loads(r["info"])["rewards"].items():
                values[f"{r['env']}/{name}"].append(v)
    return {k: fmean(v) for k, v in sorted(values.items())}


def _turn_summary(rows: list[dict]) -> dict[str, float]:
    """Per-step episode numbers: model turns per episode (mean, max), environment tokens, the
    truncated share, and the count of each stop reason (``stop_reason/<reason>``)."""
    done = [r for r in rows if r["error"] is None]
    if not done:
        return {}
    turns = [r.get("num_turns") or 1 for r in done]
    out = {
        "turns_mean": fmean(turns),
        "turns_max": float(max(turns)),
        "env_tokens": float(sum(len(r["completion_ids"]) - sum(loss_mask(r)) for r in done)),
        "truncated_fraction": fmean(bool(r.get("truncated")) for r in done),
    }
    for r in done:
        key = f"stop_reason/{r.get('stop_reason') or r['finish_reason']}"
        out[key] = out.get(key, 0.0) + 1.0
    return out


async def evaluate_policy(
    cfg: RunConfig,
    model_path: str,
    envs: dict[str, Environment],
    client: InferencePool | InferenceClient,
    samples: int | None = None,
) -> Evaluation:
    """The held-out evaluation (``evaluation.py``): ``samples`` (default
    ``sampling.eval_samples``) samples of each held-out prompt from the policy ``client`` serves."""
    k = samples or cfg.sampling.eval_samples
    prompts = eval_prompts(cfg, envs)
    rctx = make_rollout_context(
        cfg, model_path, client, SamplingStats(), temperature=eval_temperature(cfg.sampling, k)
    )
    results = await generate_groups(envs, prompts, rctx, k, cfg.inference.max_concurrency)
    return summarise(prompts, results, k, cfg.sampling.eval_pass_reward)


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate(ctx: RunContext) -> Evaluation:
    """The run's held-out evaluation, on its inference deployment (a short-lived client)."""

    async def run():
        client = InferencePool.following(
            ctx.inference_fleet(),
            timeout_s=ctx.config.inference.request_timeout_s,
            api_key=ctx.inference[0].token,
        )
        try:
            envs = build_envs(ctx.config, ctx.model_path)
            return await evaluate_policy(ctx.config, ctx.model_path, envs, client)
        finally:
            await client.aclose()

    return asyncio.run(run())
