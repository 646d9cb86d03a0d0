"""The advantage stage: filters + group advantages (``train.advantage``), written to ``batches/step=N``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.tasks.advantage.advantages import (
    Overlong,
    advantage_fn,
    build_batch,
    num_loss_tokens,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """The step's committed training batch: the groups it kept and what the filters dropped
    (None when a committed batch was reused, whose filter counts are not recorded)."""

    group_indices: list[int]
    num_samples_kept: int
    sample_keys: list[tuple[int, int]] = field(default_factory=list)  # (group, sample) per row
    num_failed_samples: int | None = None
    num_zero_advantage_groups: int | None = None
    failure_reasons: dict[str, int] = field(default_factory=dict)
    num_truncated: int | None = None  # samples cut short (train.truncated says what became of them)
    # The model's tokens of the kept rows and of the zero-advantage groups' (train.token_mean = "batch")
    num_loss_tokens: int = 0

    @property
    def num_groups_kept(self) -> int:
        return len(self.group_indices)


@task(name="advantage", cache_policy=NO_CACHE, persist_result=False)
def advantage(
    ctx: RunContext, step: int, reuse: bool = False, group_scored_envs: list[str] = ()
) -> Batch:
    """Build the step's training batch (or, with ``reuse``, take its committed one).

    A failed sample of an individually scored env is dropped and its group kept (the advantage
    is computed over the survivors); in a group-scored env (``group_scored_envs``) it drops the
    whole group. Failures are counted by reason and logged.
    """
    storage, cfg = ctx.storage, ctx.config
    if reuse and storage.is_committed("batches", step):
        batch = storage.read_step_table("batches", step)
        return Batch(
            sorted(set(batch.column("group_index").to_pylist())),
            batch.num_rows,
            sample_keys=_sample_keys(batch),
            num_loss_tokens=num_loss_tokens(batch),
        )
    storage.remove_step("batches", step)
    rollouts = storage.read_step_table("rollouts", step)
    batch, stats = build_batch(
        rollouts,
        advantage_fn(cfg.train),
        set(group_scored_envs),
        cfg.train.filter_zero_advantage,
        Overlong(
            cfg.train.truncated,
            cfg.train.overlong_limit(cfg.sampling.max_tokens),
            cfg.train.overlong_buffer_tokens,
            cfg.train.overlong_penalty,
        ),
    )
    if stats.num_failed_samples:
        log.warning(
            "step %d: %d failed samples left out of the batch, by reason: %s",
            step,
            stats.num_failed_samples,
            dict(stats.failure_reasons),
        )
    storage.write_step_table("batches", step, batch)
    return Batch(
        sorted(set(batch.column("group_index").to_pylist())),
        batch.num_rows,
        _sample_keys(batch),
        stats.num_failed_samples,
        stats.num_zero_advantage_groups,
        dict(stats.failure_reasons),
        stats.num_truncated,
        num_loss_tokens(batch),
    )


def _sample_keys(batch) -> list[tuple[int, int]]:
    return list(
        zip(
            batch.column("group_index").to_pylist(),
            batch.column("sample_index").to_pylist(),
            strict=True,
        )
    )
