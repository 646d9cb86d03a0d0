"""Per-environment moments of per-sequence figures: merged exactly, summarised at the very end.

A per-sequence quantity (a sequence's mean loss, clip fraction, entropy, mismatch KL, effective
sample size, KL to the reference) is kept as ``Moments`` (count, sum, sum of squares, max) per
environment and for ``all``. Moments merge exactly across micro-batches, ranks and mini-batches,
and only become ``name/<env>/mean``, ``/std`` and ``/max`` at the very end, so a step's figures
do not depend on how its work was split.

Both sides of the trainer's contract use it: the ranks add and merge (``trainer/``), a
``forward_backward`` reply carries the merged table as ``PerEnvJSON`` (``trainer/protocol.py``),
and the run process merges a step's replies (``tasks/train``). Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALL = "all"

MomentsJSON = tuple[float, float, float, float]
"""``Moments`` on the wire: count, sum, sum of squares, max (0 when the count is 0)."""
PerEnvJSON = dict[str, dict[str, MomentsJSON]]
"""``PerEnvMoments`` on the wire: name -> env -> ``MomentsJSON``."""


@dataclass
class Moments:
    """Count, sum, sum of squares and maximum of a stream of numbers (JSON: a 4-list)."""

    n: float = 0.0
    total: float = 0.0
    total_sq: float = 0.0
    max: float = -math.inf

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.total_sq += value * value
        self.max = max(self.max, value)

    def merge(self, other: Moments) -> None:
        self.n += other.n
        self.total += other.total
        self.total_sq += other.total_sq
        self.max = max(self.max, other.max)

    def summary(self) -> dict[str, float]:
        if not self.n:
            return {"mean": math.nan, "std": math.nan, "max": math.nan}
        mean = self.total / self.n
        var = max(0.0, self.total_sq / self.n - mean * mean)
        return {"mean": mean, "std": math.sqrt(var), "max": self.max}

    def to_json(self) -> list[float]:
        return [self.n, self.total, self.total_sq, self.max if self.n else 0.0]

    @classmethod
    def from_json(cls, data: MomentsJSON | list[float]) -> Moments:
        n, total, total_sq, mx = data
        return cls(n, total, total_sq, mx if n else -math.inf)


class PerEnvMoments:
    """``name -> env -> Moments``, with every value also counted under ``all``."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, Moments]] = {}

    def add(self, name: str, env: str, value: float) -> None:
        if math.isnan(value):
            return
        by_env = self.table.setdefault(name, {})
        for key in (ALL, env):
            by_env.setdefault(key, Moments()).add(value)

    def merge_json(self, data: PerEnvJSON) -> None:
        for name, by_env in data.items():
            mine = self.table.setdefault(name, {})
            for env, moments in by_env.items():
                mine.setdefault(env, Moments()).merge(Moments.from_json(moments))

    def to_json(self) -> dict[str, dict[str, list[float]]]:
        return {
            name: {env: m.to_json() for env, m in by_env.items()}
            for name, by_env in self.table.items()
        }

    def flat(self) -> dict[str, float]:
        """``{"name/env/mean": ..., "name/env/std": ..., "name/env/max": ...}``."""
        out = {}
        for name, by_env in sorted(self.table.items()):
            for env, m in sorted(by_env.items(), key=lambda kv: (kv[0] != ALL, kv[0])):
                for stat, value in m.summary().items():
                    out[f"{name}/{env}/{stat}"] = value
        return out
