"""Policy-gradient losses over completion tokens.

Every loss returns the SUM of its per-token terms; the caller divides by the number of loss
tokens of the whole optimizer step (all micro-batches, later all ranks), so that a token counts
the same wherever it lands. Summed terms add: the loss of a batch is the sum of the losses of
any split of it into whole sequences (GSPO's ratio is per sequence, so a sequence must never be
split across micro-batches).

Three logprobs per token may be in play:
- ``logprobs``: the trainer's current policy, the only one with a gradient;
- ``old_logprobs``: the behaviour policy the ratio is taken against (the trainer's own logprobs
  of the weights that sampled, or the sampler's when nothing recomputes them);
- ``inference_logprobs``: what the sampler (vLLM) reported. When it differs from ``old``,
  truncated importance sampling reweights each token by min(exp(old - inference), C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollflow.infra.config import LossConfig


@dataclass
class LossOutput:
    """Summed loss and summed statistics over the masked tokens of one micro-batch.

    Every ``*_sum`` and ``*_tokens`` field is a sum over loss tokens: divide by the global number
    of loss tokens for a mean. ``sums_B`` holds the same sums per sequence (detached, shape [B])
    so that the caller can group them by environment.
    """

    loss_sum: torch.Tensor
    num_tokens: int
    clipped_tokens: float
    ratio_sum: float
    mismatch_kl_sum: float
    pg_loss_sum: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    tis_weight_sum: float = 0.0
    tis_capped_tokens: float = 0.0
    is_masked_tokens: float = 0.0
    # Loss tokens by log importance ratio (sampler → trainer's old policy), IS_HIST_EDGES bins
    # plus one below and one above: sums over micro-batches and ranks, quantiles at the end.
    is_hist: list[float] = field(default_factory=list)
    sums_B: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, right-padded to [B, T]; ``mask_B_T`` marks loss tokens.

    Only ``logprobs_B_T`` (and ``entropy_B_T``, if the bonus is on) should carry a gradient.
    ``inference_logprobs_B_T`` enables TIS, ``ref_logprobs_B_T`` the KL term and its metric,
    ``entropy_B_T`` the entropy bonus and its metric.
    """

    logprobs_B_T: torch.Tensor
    old_logprobs_B_T: torch.Tensor
    advantages_B: torch.Tensor
    mask_B_T: torch.Tensor
    inference_logprobs_B_T: torch.Tensor | None = None
    ref_logprobs_B_T: torch.Tensor | None = None
    entropy_B_T: torch.Tensor | None = None


# ------------------------------------------------------------------------- per-token terms


def clipped_surrogate_B_T(
    ratio_B_T: torch.Tensor, advantages_B: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A) and where the clip is active.

    A token counts as clipped when the clipped branch wins strictly, i.e. exactly when its
    gradient is zero; at the boundary itself the two branches tie and the gradient flows.
    """
    adv_B_T = advantages_B[:, None].to(ratio_B_T.dtype).expand_as(ratio_B_T)
    unclipped_B_T = ratio_B_T * adv_B_T
    clipped_B_T = torch.clamp(ratio_B_T, 1 - eps_low, 1 + eps_high) * adv_B_T
    loss_B_T = -torch.minimum(unclipped_B_T, clipped_B_T)
    return loss_B_T, (clipped_B_T < unclipped_B_T).detach()


def gspo_token_ratio_B_T(
    logprobs_B_T: torch.Tensor, old_logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor
) -> torch.Tensor:
    """GSPO-token ratio: s_i · π(y_t) / sg[π(y_t)], with s_i = exp(mean_t(logp - old)) detached.

    Its value at every token of sequence i is the sequence ratio s_i, the geometric mean of the
    token ratios over the loss tokens; its gradient at token t is s_i · ∇log π(y_t). Summed over
    the |y_i| tokens this is |y_i| times the gradient of the sequence-level GSPO objective
    (paper eq. 5 vs. eq. 10: identical when the advantage is the same for every token).
    """
    mask_b = mask_B_T.bool()
    log_ratio_B_T = torch.where(mask_b, logprobs_B_T - old_logprobs_B_T, 0.0)
    num_tokens_B = mask_b.sum(-1).clamp(min=1)
    seq_log_ratio_B = log_ratio_B_T.detach().sum(-1) / num_tokens_B
    token_log_ratio_B_T = torch.where(mask_b, logprobs_B_T - logprobs_B_T.detach(), 0.0)
    return torch.exp(seq_log_ratio_B[:, None] + token_log_ratio_B_T)


def tis_weights_B_T(
    old_logprobs_B_T: torch.Tensor, inference_logprobs_B_T: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights min(exp(old - inference), cap), detached."""
    with torch.no_grad():
        return torch.exp(old_logprobs_B_T - inference_logprobs_B_T).clamp(max=cap)


# Bins of the log importance ratio for its quantiles: 0.02 wide over [-3.01, 3.01] (a ratio known
# to ~2%), centred on -3.00, ..., 0, ..., 3.00 so that ratios of exactly 1 (on-policy tokens) read
# as 1, plus one bin below and one above.
IS_HIST_EDGES = torch.linspace(-3.01, 3.01, 302, dtype=torch.float64)


def importance_log_ratio_B_T(
    old_logprobs_B_T: torch.Tensor,
    inference_logprobs_B_T: torch.Tensor,
    mask_b_B_T: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """log of the sampler → trainer importance ratio at every loss token, detached: per token
    (old - inference), per sequence (its sum over the sequence's loss tokens, the same at each),
    or the sequence's geometric mean (that sum over its loss-token count)."""
    with torch.no_grad():
        d_B_T = torch.where(mask_b_B_T, old_logprobs_B_T - inference_logprobs_B_T, 0.0)
        if level == "token":
            return d_B_T
        total_B = d_B_T.sum(-1)
        if level == "geometric":
            total_B = total_B / mask_b_B_T.sum(-1).clamp(min=1)
        elif level != "sequence":
            raise ValueError(f"unknown importance level {level!r}")
        return torch.where(mask_b_B_T, total_B[:, None].expand_as(d_B_T), 0.0)


def rollout_correction_B_T(
    log_ratio_B_T: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight of the policy-gradient term and which tokens the band keeps.

    weight = min(ratio, tis_cap) (ratio itself without a cap; 1 when no correction is on), and
    0 where the ratio leaves [mask_low, mask_high]: those tokens (or whole sequences, at sequence
    level) are dropped from the loss, as masked importance sampling does.
    """
    with torch.no_grad():
        ratio_B_T = torch.exp(log_ratio_B_T)
        kept_B_T = torch.ones_like(ratio_B_T, dtype=torch.bool)
        if cfg.mask_low is not None:
            kept_B_T &= ratio_B_T >= cfg.mask_low
        if cfg.mask_high is not None:
            kept_B_T &= ratio_B_T <= cfg.mask_high
        if not cfg.corrects:
            return torch.ones_like(ratio_B_T), kept_B_T
        weight_B_T = ratio_B_T.clamp(max=cfg.tis_cap) if cfg.tis_cap is not None else ratio_B_T
        return torch.where(kept_B_T, weight_B_T, 0.0), kept_B_T


def ratio_quantiles(hist: list[float], qs: tuple[float, ...] = (0.05, 0.5, 0.95)) -> list[float]:
    """Quantiles of the importance ratio from ``is_hist`` counts (bin midpoints; the outer bins
    report their edge, e^-3.01 or e^3.01)."""
    total = sum(hist)
    if total <= 0:
        return [float("nan")] * len(qs)
    edges = IS_HIST_EDGES.tolist()
    mids = [edges[0]] + [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)] + [edges[-1]]
    out, cum, i = [], 0.0, 0
    for q in qs:
        while i < len(hist) - 1 and cum + hist[i] < q * total:
            cum += hist[i]
            i += 1
        out.append(math.exp(mids[i]))
    return out


def _histogram(log_ratio_B_T: torch.Tensor, mask_b_B_T: torch.Tensor) -> list[float]:
    x = log_ratio_B_T[mask_b_B_T].to(torch.float64).cpu()
    edges = IS_HIST_EDGES
    inner = torch.histc(x, bins=len(edges) - 1, min=float(edges[0]), max=float(edges[-1]))
    below, above = float((x < edges[0]).sum()), float((x > edges[-1]).sum())
    return [below, *inner.tolist(), above]


def k3_B_T(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(π || π_ref) per token sampled from π: exp(d) - d - 1, d = ref - logp.

    Non-negative, zero exactly where the two logprobs agree; its gradient pulls logp toward ref.
    """
    d_B_T = ref_logprobs_B_T - logprobs_B_T
    return torch.exp(d_B_T) - d_B_T - 1


# ------------------------------------------------------------------------------ the loss


def compute_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Summed loss of one micro-batch: policy gradient (PPO or GSPO) · correction + β·k3 - c·entropy.

    ``ppo``: token ratio exp(logp - old), clipped per token.
    ``gspo``: GSPO-token (see ``gspo_token_ratio_B_T``): the sequence's geometric-mean ratio,
    clipped as a whole, with each token's gradient through its own logprob. Because the caller
    divides by the global token count, a sequence weighs by its length (token-level mean), not
    1/G as in the paper's sequence-level mean.

    The rollout correction (``rollout_correction_B_T``: truncated importance weights at token,
    sequence or geometric-mean level, and masking outside a band) multiplies the policy-gradient
    term only (per token, for both kinds); the KL and entropy terms are unweighted. ``mismatch_kl`` is k3 of KL(sampler || trainer) between the
    current logprobs and the inference logprobs (``old`` when no inference logprobs are given).
    """
    _check_inputs(inputs, cfg)
    logp_B_T, old_B_T = inputs.logprobs_B_T, inputs.old_logprobs_B_T
    mask_b = inputs.mask_B_T.bool()

    if cfg.kind == "ppo":
        ratio_B_T = torch.exp(torch.where(mask_b, logp_B_T - old_B_T, 0.0))
    else:
        ratio_B_T = gspo_token_ratio_B_T(logp_B_T, old_B_T, mask_b)
    pg_B_T, clipped_B_T = clipped_surrogate_B_T(
        ratio_B_T, inputs.advantages_B, cfg.eps_low, cfg.eps_high
    )

    stats_B_T: dict[str, torch.Tensor] = {}
    is_hist: list[float] = []
    if inputs.inference_logprobs_B_T is not None:
        log_w_B_T = importance_log_ratio_B_T(
            old_B_T, inputs.inference_logprobs_B_T, mask_b, cfg.is_level
        )
        weight_B_T, kept_B_T = rollout_correction_B_T(log_w_B_T, cfg)
        if cfg.corrects:
            pg_B_T = pg_B_T * weight_B_T
        stats_B_T["tis_weight"] = weight_B_T
        capped_B_T = (
            torch.exp(log_w_B_T) >= cfg.tis_cap
            if cfg.tis_cap is not None
            else torch.zeros_like(mask_b)
        )
        stats_B_T["tis_capped"] = capped_B_T & kept_B_T
        stats_B_T["is_masked"] = ~kept_B_T
        is_hist = _histogram(log_w_B_T, mask_b)
    else:
        stats_B_T["tis_weight"] = torch.ones_like(ratio_B_T)
        stats_B_T["tis_capped"] = torch.zeros_like(mask_b)
        stats_B_T["is_masked"] = torch.zeros_like(mask_b)
    loss_B_T = pg_B_T

    if inputs.ref_logprobs_B_T is not None:
        kl_B_T = k3_B_T(logp_B_T, inputs.ref_logprobs_B_T)
        if cfg.kl_coef > 0:
            loss_B_T = loss_B_T + cfg.kl_coef * kl_B_T
        stats_B_T["kl"] = kl_B_T
    if inputs.entropy_B_T is not None:
        if cfg.entropy_coef > 0:
            loss_B_T = loss_B_T - cfg.entropy_coef * inputs.entropy_B_T
        stats_B_T["entropy"] = inputs.entropy_B_T

    sampler_B_T = (
        inputs.inference_logprobs_B_T if inputs.inference_logprobs_B_T is not None else old_B_T
    )
    with torch.no_grad():
        log_ratio_B_T = torch.where(mask_b, logp_B_T - sampler_B_T, 0.0)
        stats_B_T["mismatch_kl"] = log_ratio_B_T.exp() - 1 - log_ratio_B_T
    stats_B_T.update(num_tokens=mask_b, clipped_tokens=clipped_B_T, ratio=ratio_B_T, pg_loss=pg_B_T)
    sums_B = {name: _masked_sum_B(x, mask_b) for name, x in stats_B_T.items()}
    # One host sync for all the statistics, not one per field.
    totals = dict(
        zip(sums_B, torch.stack([s.sum() for s in sums_B.values()]).tolist(), strict=True)
    )

    return LossOutput(
        loss_sum=torch.where(mask_b, loss_B_T, 0.0).sum(),
        num_tokens=int(totals["num_tokens"]),
        clipped_tokens=totals["clipped_tokens"],
        ratio_sum=totals["ratio"],
        mismatch_kl_sum=totals["mismatch_kl"],
        pg_loss_sum=totals["pg_loss"],
        kl_sum=totals.get("kl", 0.0),
        entropy_sum=totals.get("entropy", 0.0),
        tis_weight_sum=totals["tis_weight"],
        tis_capped_tokens=totals["tis_capped"],
        is_masked_tokens=totals["is_masked"],
        is_hist=is_hist,
        sums_B=sums_B,
    )


def _masked_sum_B(x_B_T: torch.Tensor, mask_b_B_T: torch.Tensor) -> torch.Tensor:
    """Detached per-sequence sum over loss tokens, in float64 so that counts stay exact."""
    return torch.where(mask_b_B_T, x_B_T.detach().to(torch.float64), 0.0).sum(-1)


def _check_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    """Shapes agree, and every term the config turns on has its input."""
    shape = tuple(inputs.logprobs_B_T.shape)
    for name in (
        "old_logprobs_B_T",
        "mask_B_T",
        "inference_logprobs_B_T",
        "ref_logprobs_B_T",
        "entropy_B_T",
    ):
        x = getattr(inputs, name)
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, logprobs_B_T has {shape}")
    if tuple(inputs.advantages_B.shape) != shape[:1]:
        raise ValueError(
            f"advantages_B has shape {tuple(inputs.advantages_B.shape)}, expected {shape[:1]}"
        )
    if cfg.kl_coef > 0 and inputs.ref_logprobs_B_T is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_B_T (or set kl_coef=0)")
    if cfg.entropy_coef > 0 and inputs.entropy_B_T is None:
        raise ValueError("entropy_coef > 0 needs entropy_B_T (or set entropy_coef=0)")
