"""The ranks' metric helpers: the effective sample size of importance weights.

Per-sequence figures (a sequence's mean loss, clip fraction, entropy, mismatch KL, effective
sample size, KL to the reference) are kept as ``infra/moments.PerEnvMoments``, which both sides
of the trainer's contract share: the ranks add and merge them, and the run process merges a
step's replies (``tasks/train/train_task.summarize_optimizer_steps``).
"""

from __future__ import annotations

import math


def effective_sample_size(weight_sum: float, weight_sq_sum: float, n: float) -> float:
    """Normalised ESS of importance weights, (sum w)^2 / (n sum w^2), in (0, 1]; 1 when all equal."""
    if n <= 0 or weight_sq_sum <= 0:
        return math.nan
    return weight_sum * weight_sum / (n * weight_sq_sum)
