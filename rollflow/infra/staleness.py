"""The staleness rule, one owner for the config, the rollout producer and the resume rule.

Invariant: a group that started from policy version ``v`` may be trained on at step ``N`` iff

    v >= N - 1 - S        (S = ``train.max_staleness``; step N trains on version N - 1)

i.e. iff ``N <= newest_step(v, S) = ⌊v + 1 + S⌋``. S = 0 is on-policy: step N takes only groups
sampled from version N - 1. Versions and S may be fractions of a step (a step's weights sent
``a`` of its ``n`` optimizer steps before its end are version ``N - a/n``), so every comparison
allows ``STALENESS_EPS`` of rounding, always in the direction that admits the exact value.

Owns: ``STALENESS_EPS`` and every use of ``⌊· + EPS⌋`` on versions and staleness bounds.
"""

from __future__ import annotations

import math

# Policy versions and staleness are steps with fractions (a step's optimizer steps / its
# optimizer steps): comparisons of two of them allow this much rounding.
STALENESS_EPS = 1e-6


def whole_steps(max_staleness: float) -> int:
    """The whole steps of a staleness bound: ``⌊S⌋``, with 0.9999999 counted as 1."""
    return math.floor(max_staleness + STALENESS_EPS)


def oldest_allowed_version(step: int, max_staleness: float) -> float:
    """The oldest policy version a group trained on at ``step`` may have started from (``N - 1 - S``,
    less the rounding allowance): compare with ``>=``."""
    return step - 1 - max_staleness - STALENESS_EPS


def allowed(version_started: float, step: int, max_staleness: float) -> bool:
    """Whether a group that started from ``version_started`` may be trained on at ``step``."""
    return version_started >= oldest_allowed_version(step, max_staleness)


def newest_step(version: float, max_staleness: float) -> int:
    """The last step a group starting now, from ``version``, may be trained on: ``⌊v + 1 + S⌋``."""
    return math.floor(version + 1 + max_staleness + STALENESS_EPS)


def version_went_back(new: float, old: float) -> bool:
    """Whether ``new`` is an older policy version than ``old`` (beyond rounding)."""
    return new < old - STALENESS_EPS
