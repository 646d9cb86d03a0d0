"""The advantage stage: filters + GRPO advantages, written to ``batches/step=N``."""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.tasks.advantage.advantages import build_batch, grpo_advantages

log = logging.getLogger(__name__)


@task(name="advantage", cache_policy=NO_CACHE, persist_result=False)
def advantage(ctx: RunContext, step: int, reuse: bool = False, group_scored_envs: list[str] = ()) -> dict:
    """Build the step's training batch; returns its groups split into mini-batches.

    A failed sample of an individually scored env is dropped and its group kept (the advantage
    is computed over the survivors); in a group-scored env (``group_scored_envs``) it drops the
    whole group. Failures are counted by reason and logged.
    """
    storage, cfg = ctx.storage, ctx.config
    if not (reuse and storage.is_committed("batches", step)):
        storage.remove_step("batches", step)
        rollouts = storage.read_step_table("rollouts", step)
        batch, stats = build_batch(rollouts, partial(grpo_advantages, normalize_std=cfg.train.normalize_std),
                                   set(group_scored_envs), cfg.train.filter_zero_advantage)
        if stats.num_failed_samples:
            log.warning("step %d: %d failed samples left out of the batch, by reason: %s", step,
                        stats.num_failed_samples, dict(stats.failure_reasons))
        storage.write_step_table("batches", step, batch)
        summary = {"num_groups": stats.num_groups, "num_failed_samples": stats.num_failed_samples,
                   "num_zero_advantage_groups": stats.num_zero_advantage_groups,
                   "failure_reasons": dict(stats.failure_reasons)}
    else:
        batch, summary = storage.read_step_table("batches", step), {"reused": True}
    groups = sorted(set(batch.column("group_index").to_pylist()))
    num_minibatches = cfg.train.train_batch_size // cfg.train.mini_batch_size
    minibatches = [m.tolist() for m in np.array_split(np.array(groups, dtype=int), num_minibatches) if len(m)]
    return {**summary, "num_groups_kept": len(groups), "num_samples_kept": batch.num_rows,
            "minibatches": minibatches}
