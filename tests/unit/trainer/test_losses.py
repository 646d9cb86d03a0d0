import math

import pytest
import torch

from rollflow.infra.config import LossConfig
from rollflow.trainer.losses import (
    IS_HIST_EDGES,
    LossInputs,
    LossOutput,
    compute_loss,
    gspo_token_ratio_B_T,
    importance_log_ratio_B_T,
    k3_B_T,
    ratio_quantiles,
    rollout_correction_B_T,
    tis_weights_B_T,
)

F64 = torch.float64


def loss(kind: str, inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """``compute_loss`` with ``cfg``'s coefficients and the given kind."""
    return compute_loss(inputs, cfg.model_copy(update={"kind": kind}))


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _logp(values) -> torch.Tensor:
    return _t(values).requires_grad_(True)


def _one_token(ratio: float, advantage: float, cfg: LossConfig, kind: str = "ppo"):
    """Loss and d loss / d logp for a single token with old logprob 0."""
    logp = _logp([[math.log(ratio)]])
    out = loss(kind, LossInputs(logp, _t([[0.0]]), _t([advantage]), _t([[1.0]])), cfg)
    out.loss_sum.backward()
    return out, float(logp.grad[0, 0])


# ------------------------------------------------------------------------------- PPO clip

PPO = LossConfig(eps_low=0.2, eps_high=0.3, tis_cap=None)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        (1.1, 1.0, -1.1, -1.1, 0.0),  # inside: -r·A, gradient raises logp
        (1.5, 1.0, -1.3, 0.0, 1.0),  # above 1+eps_high with A>0: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0),  # below 1-eps_low with A>0: the min keeps r·A
        (0.5, -1.0, 0.8, 0.0, 1.0),  # below 1-eps_low with A<0: clipped
        (1.5, -1.0, 1.5, 1.5, 0.0),  # above with A<0: the min keeps r·A, gradient lowers logp
        (1.25, 1.0, -1.25, -1.25, 0.0),  # eps_high=0.3 lets 1.25 through (symmetric 0.2 would not)
        (0.75, -1.0, 0.8, 0.0, 1.0),  # eps_low=0.2 clips 0.75
    ],
)
def test_ppo_hand_computed(ratio, advantage, loss, grad, clipped):
    out, g = _one_token(ratio, advantage, PPO)
    assert out.loss_sum.item() == pytest.approx(loss)
    assert g == pytest.approx(grad, abs=1e-12)
    assert out.clipped_tokens == clipped
    assert out.ratio_sum == pytest.approx(ratio)


@pytest.mark.parametrize(("ratio", "advantage"), [(1.3, 1.0), (0.8, -1.0)])
def test_ppo_clip_boundaries(ratio, advantage):
    # Just inside the boundary the gradient flows; just outside it is zero and counted clipped.
    inside, g_in = _one_token(ratio * (1 - 1e-6 * advantage), advantage, PPO)
    outside, g_out = _one_token(ratio * (1 + 1e-6 * advantage), advantage, PPO)
    assert inside.clipped_tokens == 0.0 and g_in == pytest.approx(-advantage * ratio, rel=1e-5)
    assert outside.clipped_tokens == 1.0 and g_out == 0.0
    # The loss is continuous across the boundary.
    assert inside.loss_sum.item() == pytest.approx(outside.loss_sum.item(), rel=1e-5)


def test_masked_tokens_contribute_nothing():
    logp = _logp([[-1.0, 50.0, -2.0]])
    out = loss(
        "ppo",
        LossInputs(logp, _t([[-1.2, -3.0, -2.0]]), _t([1.0]), _t([[1.0, 0.0, 1.0]])),
        LossConfig(tis_cap=None),
    )
    out.loss_sum.backward()
    assert out.num_tokens == 2
    assert logp.grad[0, 1] == 0.0
    assert out.loss_sum.item() == pytest.approx(-(1.2 + 1.0))  # exp(0.2) is clipped to 1.2


# ------------------------------------------------------------------------------------ GSPO


def test_gspo_ratio_is_the_geometric_mean_of_token_ratios():
    logp = _t([[-1.0, -2.0, -0.5, 9.0]])
    old = _t([[-1.3, -1.9, -0.4, 0.0]])
    mask = _t([[1.0, 1.0, 1.0, 0.0]])  # the padded token must not enter the mean
    ratio = gspo_token_ratio_B_T(logp, old, mask)
    token_ratios = [
        math.exp(a - b) for a, b in zip([-1.0, -2.0, -0.5], [-1.3, -1.9, -0.4], strict=True)
    ]
    geo_mean = math.prod(token_ratios) ** (1 / 3)
    assert torch.allclose(ratio[0, :3], _t([geo_mean] * 3))


def test_gspo_token_gradient_is_sequence_ratio_times_advantage():
    # Two tokens with different token ratios get the same gradient -A·s.
    logp = _logp([[math.log(1.02), math.log(0.99)]])
    cfg = LossConfig(eps_low=0.05, eps_high=0.05, tis_cap=None)
    out = loss("gspo", LossInputs(logp, _t([[0.0, 0.0]]), _t([2.0]), _t([[1.0, 1.0]])), cfg)
    out.loss_sum.backward()
    s = math.sqrt(1.02 * 0.99)
    assert out.loss_sum.item() == pytest.approx(-2 * 2.0 * s)
    assert torch.allclose(logp.grad, _t([[-2.0 * s, -2.0 * s]]))
    assert out.clipped_tokens == 0.0


def test_gspo_equals_length_times_the_sequence_level_objective():
    torch.manual_seed(0)
    logp = (torch.randn(1, 5, dtype=F64) * 0.01 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(1, 5, dtype=F64) * 0.01
    cfg = LossConfig(eps_low=0.2, eps_high=0.2, tis_cap=None)
    out = loss("gspo", LossInputs(logp, old, _t([0.7]), torch.ones(1, 5, dtype=F64)), cfg)
    (grad_token,) = torch.autograd.grad(out.loss_sum, logp)
    s = torch.exp((logp - old).mean())
    seq_loss = -torch.minimum(s * 0.7, s.clamp(0.8, 1.2) * 0.7)
    (grad_seq,) = torch.autograd.grad(seq_loss, logp)
    assert out.loss_sum.item() == pytest.approx(5 * seq_loss.item())
    assert torch.allclose(grad_token, 5 * grad_seq)


def test_gspo_clips_the_whole_sequence():
    # Paper-sized epsilons: a sequence ratio of 1.001 > 1 + 4e-4 is clipped at every token.
    cfg = LossConfig(eps_low=3e-4, eps_high=4e-4, tis_cap=None)
    logp = _logp([[math.log(1.003), math.log(0.999)]])  # geometric mean ≈ 1.001
    out = loss("gspo", LossInputs(logp, _t([[0.0, 0.0]]), _t([1.0]), _t([[1.0, 1.0]])), cfg)
    out.loss_sum.backward()
    assert out.clipped_tokens == 2.0
    assert torch.all(logp.grad == 0)
    assert out.loss_sum.item() == pytest.approx(-2 * (1 + 4e-4))


# ------------------------------------------------------------------------------------- TIS


def test_tis_weight_is_capped_and_detached():
    old, inference = _t([[0.0, 0.0, 0.0]]), _t([[math.log(0.5), 0.0, math.log(2.0)]])
    assert torch.allclose(tis_weights_B_T(old, inference, 3.0), _t([[2.0, 1.0, 0.5]]))
    assert torch.allclose(tis_weights_B_T(old, inference, 1.5), _t([[1.5, 1.0, 0.5]]))


@pytest.mark.parametrize(
    ("cap", "weight", "capped"), [(1.5, 1.5, 1.0), (3.0, 2.0, 0.0), (None, 1.0, 0.0)]
)
def test_tis_scales_the_policy_gradient(cap, weight, capped):
    # Ratio 1, A = 1, the sampler gave the token half the behaviour policy's probability.
    logp = _logp([[0.0]])
    inputs = LossInputs(
        logp, _t([[0.0]]), _t([1.0]), _t([[1.0]]), inference_logprobs_B_T=_t([[math.log(0.5)]])
    )
    out = loss("ppo", inputs, LossConfig(tis_cap=cap))
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-weight)
    assert float(logp.grad[0, 0]) == pytest.approx(-weight)
    assert out.tis_weight_sum == pytest.approx(weight)
    assert out.tis_capped_tokens == capped


def test_mismatch_kl_is_against_inference_logprobs_when_given():
    logp = _logp([[-1.0]])
    without = loss("ppo", LossInputs(logp, _t([[-1.0]]), _t([1.0]), _t([[1.0]])), LossConfig())
    with_inf = loss(
        "ppo",
        LossInputs(logp, _t([[-1.0]]), _t([1.0]), _t([[1.0]]), inference_logprobs_B_T=_t([[-1.5]])),
        LossConfig(),
    )
    assert without.mismatch_kl_sum == 0.0
    assert with_inf.mismatch_kl_sum == pytest.approx(math.exp(0.5) - 1 - 0.5)


# -------------------------------------------------------------------------------- KL (k3)


def test_k3_is_zero_when_equal_and_non_negative():
    torch.manual_seed(0)
    logp = torch.randn(4, 7, dtype=F64)
    assert torch.all(k3_B_T(logp, logp) == 0)
    assert torch.all(k3_B_T(logp, torch.randn(4, 7, dtype=F64) * 3) >= 0)


def test_kl_term_hand_computed():
    # logp = 0, ref = log 2: k3 = 2 - log 2 - 1; d k3 / d logp = 1 - exp(ref - logp) = -1.
    logp = _logp([[0.0]])
    inputs = LossInputs(
        logp, _t([[0.0]]), _t([0.0]), _t([[1.0]]), ref_logprobs_B_T=_t([[math.log(2.0)]])
    )
    out = loss("ppo", inputs, LossConfig(kl_coef=0.1))
    out.loss_sum.backward()
    k3 = 1 - math.log(2.0)
    assert out.kl_sum == pytest.approx(k3)
    assert out.loss_sum.item() == pytest.approx(0.1 * k3)  # A = 0: only the KL term
    assert float(logp.grad[0, 0]) == pytest.approx(-0.1)  # descent raises logp toward ref


def test_kl_metric_without_penalty():
    logp = _logp([[0.0]])
    inputs = LossInputs(
        logp, _t([[0.0]]), _t([0.0]), _t([[1.0]]), ref_logprobs_B_T=_t([[math.log(2.0)]])
    )
    out = loss("ppo", inputs, LossConfig(kl_coef=0.0))
    assert out.kl_sum == pytest.approx(1 - math.log(2.0))
    assert out.loss_sum.item() == 0.0


# --------------------------------------------------------------------------------- entropy


def test_entropy_bonus_hand_computed():
    entropy = _logp([[1.5, 0.5, 9.0]])
    inputs = LossInputs(
        _logp([[0.0, 0.0, 0.0]]),
        _t([[0.0, 0.0, 0.0]]),
        _t([0.0]),
        _t([[1.0, 1.0, 0.0]]),
        entropy_B_T=entropy,
    )
    out = loss("gspo", inputs, LossConfig(entropy_coef=0.01))
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-0.01 * 2.0)
    assert out.entropy_sum == pytest.approx(2.0)
    assert torch.allclose(entropy.grad, _t([[-0.01, -0.01, 0.0]]))  # descent raises entropy


# ------------------------------------------------------------------------- sum convention


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    return {
        "logprobs_B_T": old + torch.randn(B, T, generator=g, dtype=F64) * 0.2,
        "old_logprobs_B_T": old,
        "advantages_B": torch.randn(B, generator=g, dtype=F64),
        "mask_B_T": mask,
        "inference_logprobs_B_T": old + torch.randn(B, T, generator=g, dtype=F64) * 0.3,
        "ref_logprobs_B_T": old + torch.randn(B, T, generator=g, dtype=F64) * 0.3,
        "entropy_B_T": torch.rand(B, T, generator=g, dtype=F64),
    }


def _run(kind, batch, rows, cfg) -> tuple[LossOutput, torch.Tensor]:
    leaf = batch["logprobs_B_T"][rows].clone().requires_grad_(True)
    parts = {k: v[rows] for k, v in batch.items()} | {"logprobs_B_T": leaf}
    out = loss(kind, LossInputs(**parts), cfg)
    out.loss_sum.backward()
    return out, leaf.grad


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_two_halves_sum_to_the_whole(kind):
    batch = _batch(seed=3)
    cfg = LossConfig(eps_low=0.1, eps_high=0.15, tis_cap=1.5, kl_coef=0.05, entropy_coef=0.01)
    whole, grad_whole = _run(kind, batch, slice(0, 6), cfg)
    first, grad_first = _run(kind, batch, slice(0, 2), cfg)
    second, grad_second = _run(kind, batch, slice(2, 6), cfg)
    assert (first.loss_sum + second.loss_sum).item() == pytest.approx(whole.loss_sum.item())
    assert torch.allclose(torch.cat([grad_first, grad_second]), grad_whole)
    for name in (
        "num_tokens",
        "clipped_tokens",
        "ratio_sum",
        "mismatch_kl_sum",
        "pg_loss_sum",
        "kl_sum",
        "entropy_sum",
        "tis_weight_sum",
        "tis_capped_tokens",
        "is_masked_tokens",
    ):
        assert getattr(first, name) + getattr(second, name) == pytest.approx(
            getattr(whole, name)
        ), name
    assert whole.clipped_tokens > 0 and whole.tis_capped_tokens > 0  # the example exercises both
    for name, sums_B in whole.sums_B.items():
        assert torch.allclose(sums_B, torch.cat([first.sums_B[name], second.sums_B[name]])), name
        field = {
            "num_tokens": "num_tokens",
            "clipped_tokens": "clipped_tokens",
            "ratio": "ratio_sum",
            "mismatch_kl": "mismatch_kl_sum",
            "pg_loss": "pg_loss_sum",
            "kl": "kl_sum",
            "entropy": "entropy_sum",
            "tis_weight": "tis_weight_sum",
            "tis_capped": "tis_capped_tokens",
            "is_masked": "is_masked_tokens",
        }
        assert sums_B.shape == (6,)
        assert sums_B.sum().item() == pytest.approx(getattr(whole, field[name])), name


# -------------------------------------------------------------------------------- errors


def test_invalid_config_and_missing_inputs_are_named():
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.0)
    inputs = LossInputs(_t([[0.0]]), _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    with pytest.raises(ValueError, match="ref_logprobs_B_T"):
        loss("ppo", inputs, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_B_T"):
        loss("ppo", inputs, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="kind"):
        LossConfig(kind="grpo")
    with pytest.raises(ValueError, match="old_logprobs_B_T"):
        loss("ppo", LossInputs(_t([[0.0]]), _t([[0.0, 0.0]]), _t([1.0]), _t([[1.0]])), LossConfig())


# ------------------------------------------------------------- rollout correction


def _two_sequences():
    """Two sequences of 3 loss tokens (the second has a padding slot) with known log-ratios
    old - inference: [0.1, -0.2, 0.4] and [1.0, 1.0, pad]."""
    old = torch.tensor([[0.1, -0.2, 0.4], [1.0, 1.0, 0.0]])
    inference = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    return old, inference, mask


def test_importance_ratio_levels_by_hand():
    old, inf, mask = _two_sequences()
    token = importance_log_ratio_B_T(old, inf, mask, "token")
    assert torch.allclose(token, torch.tensor([[0.1, -0.2, 0.4], [1.0, 1.0, 0.0]]))
    seq = importance_log_ratio_B_T(old, inf, mask, "sequence")
    assert torch.allclose(seq, torch.tensor([[0.3, 0.3, 0.3], [2.0, 2.0, 0.0]]))
    geo = importance_log_ratio_B_T(old, inf, mask, "geometric")
    assert torch.allclose(geo, torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 0.0]]))


def test_truncation_and_masking_by_hand():
    old, inf, mask = _two_sequences()
    log_w = importance_log_ratio_B_T(old, inf, mask, "token")
    # Truncated IS: min(e^d, 2): e^0.1, e^-0.2, e^0.4 | 2, 2
    w, kept = rollout_correction_B_T(log_w, LossConfig(tis_cap=2.0))
    assert torch.allclose(w[0], torch.exp(torch.tensor([0.1, -0.2, 0.4])))
    assert torch.allclose(w[1, :2], torch.tensor([2.0, 2.0])) and kept.all()
    # Token masking outside [0.9, 1.2]: e^-0.2 = 0.82 and e^0.4 = 1.49 and e^1 go
    w, kept = rollout_correction_B_T(log_w, LossConfig(mask_low=0.9, mask_high=1.2))
    assert kept[0].tolist() == [True, False, False] and not kept[1, :2].any()
    assert w[0, 0] == pytest.approx(math.exp(0.1)) and w[0, 1:].tolist() == [0.0, 0.0]
    # Sequence masking: sequence 0's ratio e^0.3 = 1.35 stays in [0.5, 2], sequence 1's e^2 goes
    seq = importance_log_ratio_B_T(old, inf, mask, "sequence")
    w, kept = rollout_correction_B_T(
        seq, LossConfig(is_level="sequence", mask_low=0.5, mask_high=2.0)
    )
    assert kept[0].all() and not kept[1, :2].any()
    assert torch.allclose(w[0], torch.full((3,), math.exp(0.3)))
    # No correction: weight 1 everywhere
    w, _ = rollout_correction_B_T(log_w, LossConfig())
    assert torch.equal(w, torch.ones_like(w))


def test_masked_tokens_leave_the_loss_and_are_counted():
    """logp = old (ratio 1, no clip) and advantage 1: each loss token adds -weight to the loss."""
    old, inf, mask = _two_sequences()
    inputs = LossInputs(
        logprobs_B_T=old.clone(),
        old_logprobs_B_T=old,
        advantages_B=torch.ones(2),
        mask_B_T=mask.float(),
        inference_logprobs_B_T=inf,
    )
    cfg = LossConfig(mask_low=0.9, mask_high=1.2, tis_cap=1.1)
    out = compute_loss(inputs, cfg)
    # kept: token (0, 0) only, weight min(e^0.1, 1.1) = 1.1
    assert out.loss_sum.item() == pytest.approx(-1.1)
    assert out.is_masked_tokens == 4 and out.num_tokens == 5
    assert sum(out.is_hist) == 5


def test_ratio_quantiles_from_the_histogram():
    old = torch.linspace(-0.5, 0.5, 101)[None, :]
    inputs = LossInputs(
        logprobs_B_T=old.clone(),
        old_logprobs_B_T=old,
        advantages_B=torch.ones(1),
        mask_B_T=torch.ones_like(old),
        inference_logprobs_B_T=torch.zeros_like(old),
    )
    out = compute_loss(inputs, LossConfig())
    q05, q50, q95 = ratio_quantiles(out.is_hist)
    assert q50 == pytest.approx(1.0, abs=1e-12)  # the median token is on-policy: exactly 1
    assert q05 == pytest.approx(math.exp(-0.45), rel=0.03)
    assert q95 == pytest.approx(math.exp(0.45), rel=0.03)


def test_correction_metrics_reach_the_step_metrics():
    from rollflow.trainer.compute import merge_forward_backward
    from rollflow.trainer.rank_trainer import SUM_KEYS

    hist = [0.0] * (len(IS_HIST_EDGES) + 1)
    hist[151] = (
        10.0  # every token at log-ratio ~0 (inner bin 150, [-0.01, 0.01], after the under-bin)
    )
    part = {"sums": dict.fromkeys(SUM_KEYS, 0.0), "per_env": {}, "is_hist": hist}
    part["sums"].update(num_loss_tokens=10, is_masked_tokens=2)
    merged = merge_forward_backward([part, part], denominator=20, elapsed_s=0.1)
    assert merged["is_masked_fraction"] == pytest.approx(0.2)
    assert merged["is_ratio_q50"] == pytest.approx(1.0, abs=1e-12)
    assert {"is_ratio_q05", "is_ratio_q95"} <= set(merged)
