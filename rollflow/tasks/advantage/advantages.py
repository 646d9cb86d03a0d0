"""Filters and per-group advantages: rollouts in, a training batch out.

Contract of an advantage function: it takes the rewards of ONE group (the samples that survived
the filters) and returns one float per sample, in order. Groups may differ in size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

AdvantageFn = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True)
class Overlong:
    """What happens to samples cut short (``truncated``: a model turn hit ``max_tokens``, or an
    episode its turn or token limit), after DAPO (Yu et al. 2025, section 3.4):

    - ``keep``: trained as they are;
    - ``drop``: overlong filtering: left out of the batch, and out of their group's baseline;
    - ``penalize``: soft overlong punishment added to the reward: 0 up to ``max_tokens -
      buffer_tokens`` model tokens, then falling linearly to ``-penalty`` at ``max_tokens``;
      a truncated sample always gets the whole ``-penalty``.
    """

    mode: str = "keep"
    max_tokens: int = 0
    buffer_tokens: int = 0
    penalty: float = 1.0

    def reward_penalty(self, row: dict) -> float:
        if row.get("truncated"):
            return -self.penalty
        if self.buffer_tokens <= 0:
            return 0.0
        mask = row.get("completion_mask")
        length = sum(mask) if mask is not None else len(row["completion_ids"])
        over = length - (self.max_tokens - self.buffer_tokens)
        return -self.penalty * min(max(over / self.buffer_tokens, 0.0), 1.0)


def grpo_advantages(
    rewards_G: Sequence[float], normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Reward minus the group mean, optionally divided by the group's std."""
    mean = sum(rewards_G) / len(rewards_G)
    advantages_G = [r - mean for r in rewards_G]
    if normalize_std and len(rewards_G) > 1:
        std = math.sqrt(sum(a * a for a in advantages_G) / (len(rewards_G) - 1))
        advantages_G = [a / (std + eps) for a in advantages_G]
    return advantages_G


@dataclass
class BatchStats:
    """What the filters did to one step's rollouts."""

    num_groups: int = 0
    num_groups_kept: int = 0
    num_samples: int = 0
    num_samples_kept: int = 0
    num_failed_samples: int = 0
    num_zero_advantage_groups: int = 0
    num_truncated: int = 0  # samples marked truncated (dropped with Overlong "drop")
    failure_reasons: Counter = field(default_factory=Counter)


def build_batch(
    rollouts: pa.Table,
    advantage_fn: AdvantageFn,
    group_scored_envs: set[str] = frozenset(),
    filter_zero_advantage: bool = True,
    overlong: Overlong = Overlong(),
) -> tuple[pa.Table, BatchStats]:
    """Rows of the groups that carry signal, with ``advantage`` set.

    A failed sample (error or no reward) is dropped; its group keeps the survivors, unless its
    environment scores whole groups, in which case the whole group is dropped. Truncated samples
    are kept, dropped or penalised as ``overlong`` says (the batch's ``reward`` then holds the
    penalised reward; the rollouts keep the environment's).
    """
    rows = rollouts.to_pylist()
    num_truncated = sum(bool(r.get("truncated")) for r in rows)
    if overlong.mode == "drop":
        rows = [r for r in rows if not r.get("truncated")]
    elif overlong.mode == "penalize":
        rows = [
            {**r, "reward": r["reward"] + overlong.reward_penalty(r)}
            if r["reward"] is not None
            else r
            for r in rows
        ]
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_index"], []).append(row)
    stats = BatchStats(num_groups=len(groups), num_samples=len(rows), num_truncated=num_truncated)
    kept: list[dict] = []
    for group in groups.values():
        survivors = [r for r in group if r["error"] is None and r["reward"] is not None]
        failed = [r for r in group if r["error"] is not None or r["reward"] is None]
        for r in failed:
            stats.failure_reasons[(r["error"] or "no reward").split(":")[0]] += 1
        stats.num_failed_samples += len(failed)
        if not survivors or (failed and group[0]["env"] in group_scored_envs):
            continue
        advantages = advantage_fn([r["reward"] for r in survivors])
        if len(advantages) != len(survivors):
            raise ValueError(
                f"advantage function returned {len(advantages)} values for a group of {len(survivors)}"
            )
        if filter_zero_advantage and all(abs(a) < 1e-9 for a in advantages):
            stats.num_zero_advantage_groups += 1
            continue
        stats.num_groups_kept += 1
        for r, a in zip(survivors, advantages, strict=True):
            kept.append({**r, "advantage": float(a)})
    stats.num_samples_kept = len(kept)
    return pa.Table.from_pylist(kept, schema=rollouts.schema), stats
