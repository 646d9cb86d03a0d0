"""Filters and per-group advantages: rollouts in, a training batch out.

Contract of an advantage function: it takes the rewards of ONE group (the samples that survived
the filters) and returns one float per sample, in order. Groups may differ in size.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa

from rollflow.infra.errors import ConfigError, InputError
from rollflow.infra.schema import loss_mask

AdvantageFn = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True)
class Overlong:
    """What happens to samples cut short (``truncated``: a model turn hit ``max_tokens``, or an
    episode its turn or token limit), after DAPO (Yu et al. 2025, section 3.4):

    - ``keep``: trained as they are;
    - ``drop``: overlong filtering: left out of the batch, and out of their group's baseline;
    - ``mask``: left out of the batch, but in their group's baseline (TRL's
      ``mask_truncated_completions``: their loss mask is zero, their reward still counts);
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
    """GRPO (Shao et al. 2024): reward minus the group mean, optionally divided by the group's
    (sample) std."""
    mean = sum(rewards_G) / len(rewards_G)
    advantages_G = [r - mean for r in rewards_G]
    if normalize_std and len(rewards_G) > 1:
        std = math.sqrt(sum(a * a for a in advantages_G) / (len(rewards_G) - 1))
        advantages_G = [a / (std + eps) for a in advantages_G]
    return advantages_G


def dr_grpo_advantages(rewards_G: Sequence[float]) -> list[float]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): reward minus the group
    mean, never divided by the std (which up-weights groups that are nearly all right or all
    wrong). Its other half, no per-sequence length normalisation, is the loss's already: every
    loss divides by the step's total token count."""
    return grpo_advantages(rewards_G, normalize_std=False)


def rloo_advantages(rewards_G: Sequence[float]) -> list[float]:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each sample's baseline is the mean reward of
    the group's other samples, r_i - mean_{j≠i} r_j = G/(G-1) · (r_i - mean). A group of one has
    no baseline: its advantage is 0."""
    g = len(rewards_G)
    if g < 2:
        return [0.0] * g
    total = sum(rewards_G)
    return [r - (total - r) / (g - 1) for r in rewards_G]


def pass_at_k_advantages(rewards_G: Sequence[float], k: int = 4) -> list[float]:
    """Pass@k training (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration
    and Exploitation"), analytic form for binary rewards: the group's expected pass@k over all
    k-subsets is R = 1 - C(n_neg, k) / C(n, k); a correct sample gets (1 - R) / σ, a wrong one
    (1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / σ, with σ = sqrt(R (1 - R)). Groups all
    right or all wrong get 0. k = 1 is GRPO with std normalisation (population std)."""
    n = len(rewards_G)
    if any(r not in (0, 1) for r in rewards_G):
        raise ConfigError(
            f"the pass_at_k advantage needs rewards of 0 or 1, got {sorted(set(rewards_G))}: "
            "use it with a pass/fail reward, or choose another train.advantage"
        )
    if not 1 <= k <= n:
        raise ConfigError(
            f"pass_at_k needs 1 <= k <= group size ({n}), got k = {k}: lower "
            "train.advantage_args.k or raise sampling.group_size"
        )
    n_neg = sum(1 for r in rewards_G if r == 0)
    expected = 1 - math.comb(n_neg, k) / math.comb(n, k)
    std = math.sqrt(expected * (1 - expected))
    if std == 0:
        return [0.0] * n
    # P(a k-subset holding this wrong sample has no right one): its share of the failures.
    p_fail = math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg else 0.0
    return [((1 - expected) if r == 1 else (1 - expected - p_fail)) / std for r in rewards_G]


ADVANTAGES: dict[str, Callable[..., list[float]]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "pass_at_k": pass_at_k_advantages,
}


def resolve_advantage(name: str, args: dict | None = None) -> AdvantageFn:
    """The estimator ``train.advantage`` names: a built-in name or ``package.module:function``
    (one group's rewards in, one float per sample out), with ``train.advantage_args`` bound."""
    if name in ADVANTAGES:
        fn = ADVANTAGES[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(
                f"train.advantage = {name!r}: cannot load {attr!r} from module {module_name!r} "
                f"({err}); give an importable package.module:function"
            ) from None
        if not callable(fn):
            raise ConfigError(f"train.advantage = {name!r} is not a function")
    else:
        raise ConfigError(
            f"train.advantage = {name!r} is unknown: choose one of {', '.join(ADVANTAGES)} "
            "or give package.module:function"
        )
    args = dict(args or {})
    try:
        inspect.signature(fn).bind([0.0], **args)
    except TypeError as err:
        raise ConfigError(f"train.advantage_args {args} do not fit {name!r}: {err}") from None
    return partial(fn, **args) if args else fn


def advantage_fn(train) -> AdvantageFn:
    """The run's estimator (``train.advantage``; grpo takes ``train.normalize_std``)."""
    args = dict(train.advantage_args)
    if train.advantage == "grpo":
        args.setdefault("normalize_std", train.normalize_std)
    return resolve_advantage(train.advantage, args)


@dataclass
class BatchStats:
    """What the filters did to one step's rollouts."""

    num_groups: int = 0
    num_groups_kept: int = 0
    num_samples: int = 0
    num_samples_kept: int = 0
    num_failed_samples: int = 0
    num_zero_advantage_groups: int = 0
    num_zero_advantage_tokens: int = 0  # loss tokens of the groups that filter dropped
    num_truncated: int = 0  # samples marked truncated (dropped with Overlong "drop" or "mask")
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
    are kept, dropped, masked or penalised as ``overlong`` says (the batch's ``reward`` then holds the
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
            raise InputError(
                f"advantage function returned {len(advantages)} values for a group of "
                f"{len(survivors)}; train.advantage's function must return one per reward"
            )
        trained = [
            (r, a)
            for r, a in zip(survivors, advantages, strict=True)
            if not (overlong.mode == "mask" and r.get("truncated"))
        ]
        if not trained:  # every survivor truncated and masked: nothing to train
            continue
        if filter_zero_advantage and all(abs(a) < 1e-9 for _, a in trained):
            stats.num_zero_advantage_groups += 1
            stats.num_zero_advantage_tokens += sum(sum(loss_mask(r)) for r, _ in trained)
            continue
        stats.num_groups_kept += 1
        kept.extend({**r, "advantage": float(a)} for r, a in trained)
    stats.num_samples_kept = len(kept)
    batch = pa.Table.from_pylist(kept, schema=rollouts.schema)
    metadata = {
        **(batch.schema.metadata or {}),
        FILTERED_TOKENS: str(stats.num_zero_advantage_tokens),
    }
    return batch.replace_schema_metadata(metadata), stats


# The batch table's record of the loss tokens its zero-advantage filter left out: a resumed step
# divides by the same step total as the step that wrote it.
FILTERED_TOKENS = b"rollflow.num_zero_advantage_tokens"


def num_loss_tokens(batch: pa.Table) -> int:
    """The step's loss tokens: the model's tokens (``loss_mask``) of every row of the training
    batch, and of the rows of the groups whose advantages were all zero, which the filter left out
    of it (their loss is zero either way; TRL's ``loss_type="dapo"`` counts them too)."""
    columns = [c for c in ("completion_ids", "completion_mask") if c in batch.column_names]
    kept = sum(sum(loss_mask(row)) for row in batch.select(columns).to_pylist())
    return kept + int((batch.schema.metadata or {}).get(FILTERED_TOKENS, 0))
