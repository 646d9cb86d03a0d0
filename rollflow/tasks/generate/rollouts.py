"""Turning prompts into scored groups of rollouts against the inference deployment.

Invariant: every prompt handed to ``generate_groups`` comes back as exactly one group of rows
(its samples, or error rows saying why it has none); nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rollflow.infra.errors import (
    InferenceError,
    InferenceGone,
    InferenceUnavailable,
    RequestAborted,
)
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.pool import InferencePool
from rollflow.tasks.generate.environments import Environment, Prompt, RolloutContext, Sample

log = logging.getLogger(__name__)


@dataclass
class RetryPolicy:
    """Exponential backoff for aborted or disconnected requests (no cap when ``max_tries`` is 0).

    ``unhealthy_grace_s`` covers only the time before the run's inference supervisor notices a
    dead server (at most ``services.run_services.DETECTION_BOUND_S``); once it has, the server's gate
    is closed and requests wait there through the restart, which the grace does not count.
    """

    initial_s: float = 0.2
    max_s: float = 5.0
    max_tries: int = 0
    unhealthy_grace_s: float = 20.0  # unhealthy this long, and no restart under way: dead

    def delay_s(self, attempt: int) -> float:
        return min(self.max_s, self.initial_s * 2**attempt) * (0.5 + random.random() / 2)


@dataclass
class SamplingStats:
    """Counters of one generation pass."""

    retries: int = 0
    retry_reasons: dict[str, int] = field(default_factory=dict)


class Sampler:
    """The sampling call handed to environments: one vLLM request, retried until it completes.

    Each try goes to a server of the pool (the least loaded open one, ``InferencePool.lease``),
    so a retry after a server's death goes to another server while it is restarted.
    """

    def __init__(
        self,
        client: InferencePool | InferenceClient,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        retry: RetryPolicy,
        stats: SamplingStats,
        deadline_s: float,
    ):
        self.pool = client if isinstance(client, InferencePool) else InferencePool.around(client)
        self.params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        self.retry, self.stats, self.deadline_s = retry, stats, deadline_s

    async def __call__(self, prompt_ids: list[int], n: int = 1, **overrides):
        params = {**self.params, **overrides}
        attempt = 0
        start = time.monotonic()
        unhealthy_since: float | None = None
        while True:
            try:
                with self.pool.lease() as client:
                    return await client.complete(prompt_ids, n=n, **params)
            except InferenceError as exc:
                if not _retryable(exc):
                    raise
                unhealthy_since = await self._down_since(client, exc, unhealthy_since)
                reason = type(exc).__name__
                self.stats.retries += 1
                self.stats.retry_reasons[reason] = self.stats.retry_reasons.get(reason, 0) + 1
                attempt += 1
                elapsed = time.monotonic() - start
                if (
                    self.retry.max_tries and attempt >= self.retry.max_tries
                ) or elapsed > self.deadline_s:
                    raise RuntimeError(
                        f"sampling failed after {attempt} tries over {elapsed:.0f}s: {exc}"
                    ) from exc
                log.warning("request %s (%s), retry %d", reason, exc, attempt)
                await asyncio.sleep(self.retry.delay_s(attempt - 1))

    async def _down_since(
        self, client: InferenceClient, exc: Exception, since: float | None
    ) -> float | None:
        """Since when the server has been down with no restart under way (None: it is up, its
        supervisor is restarting it, so the request waits at the gate, or it left the fleet, so
        the next try goes to another server); raises when the failure
        is final: ``InferenceGone``, or the HTTP 5xx of a healthy server (the group's error)."""
        if client.restarting or isinstance(exc, RequestAborted) or not self.pool.serves(client):
            return None  # waits at the gate, or goes to another server
        healthy = await client.health()
        if _server_failed(exc):
            if healthy:
                raise exc
            raise InferenceGone(f"vLLM failed a request and is unhealthy: {exc}") from exc
        if healthy:
            return None
        since = since or time.monotonic()
        if time.monotonic() - since > self.retry.unhealthy_grace_s:
            raise InferenceGone(
                f"vLLM unreachable for {self.retry.unhealthy_grace_s:.0f}s "
                f"and not being restarted: {exc}"
            ) from exc
        return since


def _server_failed(exc: InferenceError) -> bool:
    return exc.status is not None and exc.status >= 500


def _retryable(exc: InferenceError) -> bool:
    """Aborted, unreachable, or an HTTP 5xx: worth another try (a 4xx or ``InferenceGone`` is not)."""
    return isinstance(exc, RequestAborted | InferenceUnavailable) or _server_failed(exc)


def train_prompt_seed(run_seed: int, step: int) -> int:
    """The seed of step ``step``'s training prompts: a resumed or regenerated step draws the same."""
    return run_seed * 1_000_003 + step


def select_prompts(
    envs: dict[str, Environment], weights: dict[str, float], count: int, split: str, seed: int
) -> list[Prompt]:
    """``count`` prompts drawn from the env mix by weight; the same seed gives the same prompts."""
    rng = random.Random(seed)
    names = sorted(envs)
    picks = rng.choices(names, weights=[weights[n] for n in names], k=count)
    out: list[Prompt] = []
    for name in names:
        out.extend(envs[name].prompts(split, picks.count(name), rng))
    rng.shuffle(out)
    return out


GroupResult = list[Sample] | str  # the samples, or why the group has none


def group_has_signal(advantage: Callable[[list[float]], list[float]]):
    """For dynamic sampling: whether a finished group's scored samples get a non-zero advantage
    under the run's estimator (a group with failed samples is judged by its survivors)."""

    def has_signal(samples: list[Sample]) -> bool:
        rewards = [s.reward for s in samples if s.error is None and not math.isnan(s.reward)]
        if not rewards:
            return True  # nothing to judge: the advantage stage accounts for it
        return any(abs(a) > 1e-9 for a in advantage(rewards))

    return has_signal


RunGroup = Callable[[Prompt, float], Awaitable[GroupResult]]  # (prompt, version_started)


def group_runner(envs: dict[str, Environment], ctx: RolloutContext, group_size: int) -> RunGroup:
    """One group of a prompt: a failed group becomes its error string; ``InferenceGone`` propagates."""

    async def run_group(prompt: Prompt, version_started: float = 0) -> GroupResult:
        try:
            return await envs[prompt.env].rollout_group(prompt, group_size, ctx)
        except InferenceGone:
            raise
        except Exception as exc:
            log.warning("group %s failed: %s", prompt.prompt_id, exc)
            return f"rollout: {type(exc).__name__}: {exc}"

    return run_group


async def generate_groups(
    envs: dict[str, Environment],
    prompts: list[Prompt],
    ctx: RolloutContext,
    group_size: int,
    max_concurrency: int,
) -> list[GroupResult]:
    """One entry per prompt, in order: its samples, or the error that left it without any."""
    gate = asyncio.Semaphore(max_concurrency)
    run_group = group_runner(envs, ctx, group_size)

    async def one(prompt: Prompt) -> GroupResult:
        async with gate:
            return await run_group(prompt)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def to_rows(
    run: str,
    step: int,
    prompts: list[Prompt],
    results: list[GroupResult],
    group_size: int,
    versions: list[tuple[float, float]],
) -> list[dict]:
    """Rows of ``ROLLOUT_SCHEMA``: one per sample, or ``group_size`` error rows per failed group.

    ``versions`` holds each group's (version_started, version_finished).
    """
    rows = []
    for gi, (prompt, result, (version_started, version_finished)) in enumerate(
        zip(prompts, results, versions, strict=True)
    ):
        samples = (
            result
            if isinstance(result, list)
            else [Sample([], [], [], "", "error", error=result) for _ in range(group_size)]
        )
        for si, s in enumerate(samples):
            rows.append(
                {
                    "run": run,
                    "step": step,
                    "env": prompt.env,
                    "prompt_id": prompt.prompt_id,
                    "group_index": gi,
                    "sample_index": si,
                    "prompt_text": prompt.text,
                    "completion_text": s.completion_text,
                    "prompt_ids": s.prompt_ids,
                    "completion_ids": s.completion_ids,
                    "completion_logprobs": s.completion_logprobs,
                    "reward": None if math.isnan(s.reward) else s.reward,
                    "advantage": None,
                    "version_started": version_started,
                    "version_finished": version_finished,
                    "finish_reason": s.finish_reason,
                    "error": s.error,
                    "generate_s": s.generate_s,
                    "reward_s": s.reward_s,
                    "info": json.dumps({"answer": prompt.answer, **s.info}),
                    **s.turn_columns(version_started),
                }
            )
    return rows
