"""Training metrics: global token means plus per-sequence statistics grouped by environment.

Per-sequence quantities (a sequence's mean loss, clip fraction, entropy, mismatch KL, effective
sample size, KL to the reference) are summarised as ``Moments`` (count, sum, sum of squares, max)
per environment and for ``all``. Moments merge exactly across micro-batches, ranks and
mini-batches, and only become ``name/<env>/mean``, ``/std`` and ``/max`` at the very end, so a
step's figures do not depend on how its work was split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALL = "all"


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
    def from_json(cls, data: list[float]) -> Moments:
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

    def merge_json(self, data: dict[str, dict[str, list[float]]]) -> None:
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


def effective_sample_size(weight_sum: float, weight_sq_sum: float, n: float) -> float:
    """Normalised ESS of importance weights, (sum w)^2 / (n sum w^2), in (0, 1]; 1 when all equal."""
    if n <= 0 or weight_sq_sum <= 0:
        return math.nan
    return weight_sum * weight_sum / (n * weight_sq_sum)


# Step-level scalars averaged over a step's optimizer steps (each already a global token mean).
MEAN_KEYS = (
    "loss",
    "grad_norm",
    "clip_fraction",
    "entropy",
    "mismatch_kl",
    "ess",
    "kl",
    "tis_weight",
    "is_masked_fraction",
    "is_ratio_q05",
    "is_ratio_q50",
    "is_ratio_q95",
    "lr",
)


def summarize_optimizer_steps(results: list[dict]) -> dict[str, float]:
    """One outer step's metrics from its optimizer steps' results: a flat dict of floats.

    Scalars are averaged over optimizer steps; tokens/s is total tokens over total trainer time
    (forward_backward + optim_step); per-environment moments are merged, then summarised.
    """
    if not results:
        return {"num_optim_steps": 0, "num_loss_tokens": 0}
    out = {
        k: sum(r[k] for r in results) / len(results)
        for k in MEAN_KEYS
        if all(k in r for r in results)
    }
    busy_s = sum(r["forward_backward_s"] + r["optim_step_s"] for r in results)
    out["num_optim_steps"] = len(results)
    out["num_loss_tokens"] = sum(r["num_loss_tokens"] for r in results)
    out["num_tokens"] = sum(r["num_tokens"] for r in results)
    out["tokens_per_s"] = out["num_tokens"] / busy_s if busy_s > 0 else math.nan
    per_env = PerEnvMoments()
    for r in results:
        per_env.merge_json(r.get("per_env", {}))
    out.update(per_env.flat())
    return out
