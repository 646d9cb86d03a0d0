"""Chunked log-probs and entropy equal the full-logits reference, values and gradients.

The Triton kernels run here under the Triton interpreter (TRITON_INTERPRET=1, numpy on CPU): that
checks their arithmetic and masking, not their compilation or speed on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rollflow.gpu_kernels import logprobs as lp_mod
from rollflow.gpu_kernels.logprobs import reference_logprobs_entropy, selective_logprobs_entropy

NUM_TOKENS, HIDDEN, VOCAB = 50, 16, 97  # V prime: no chunk or tile divides it evenly


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_N_H = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    # Scaled up so the distributions are far from uniform and entropy gradients are not tiny.
    lm_head_V_H = (2.0 * torch.randn(VOCAB, HIDDEN, generator=gen)).to(dtype).requires_grad_()
    targets_N = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=gen)
    weights_lp_N = torch.randn(NUM_TOKENS, generator=gen)
    weights_ent_N = torch.randn(NUM_TOKENS, generator=gen)
    return hidden_N_H, lm_head_V_H, targets_N, weights_lp_N, weights_ent_N


def _values_and_grads(fn, hidden_N_H, lm_head_V_H, targets_N, w_lp_N, w_ent_N, use, **kw):
    """Outputs, and grads of a loss using logprobs and/or entropy ('lp', 'ent' or 'both')."""
    hidden_N_H.grad = lm_head_V_H.grad = None
    logprobs_N, entropy_N = fn(hidden_N_H, lm_head_V_H, targets_N, **kw)
    loss = 0.0
    if use in ("lp", "both"):
        loss = loss + (w_lp_N * logprobs_N).sum()
    if use in ("ent", "both"):
        loss = loss + (w_ent_N * entropy_N).sum()
    loss.backward()
    return logprobs_N.detach(), entropy_N.detach(), hidden_N_H.grad, lm_head_V_H.grad


def _assert_matches_reference(use="both", dtype=torch.float32, tol=1e-5, **kw):
    """Each tensor within `tol` of the reference, relative to that tensor's largest entry.

    Against an fp64 computation the fp32 reference itself is off by ~3e-7 of the largest entry
    and the chunked paths by ~1e-6 (different summation order): 1e-5 is fp32 agreement.
    """
    inputs = _inputs(dtype)
    ref_kw = {k: kw[k] for k in ("temperature", "top_p") if k in kw}
    got = _values_and_grads(selective_logprobs_entropy, *inputs, use, **kw)
    want = _values_and_grads(reference_logprobs_entropy, *inputs, use, **ref_kw)
    for name, g, w in zip(
        ("logprobs", "entropy", "grad hidden", "grad lm_head"), got, want, strict=True
    ):
        assert g.dtype == w.dtype, name
        scale = w.abs().max().item()
        torch.testing.assert_close(
            g, w, atol=tol * scale, rtol=tol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("chunk_size", [1, 7, 16, NUM_TOKENS, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_chunked_equals_reference(chunk_size, temperature):
    _assert_matches_reference(chunk_size=chunk_size, temperature=temperature)


@pytest.mark.parametrize("chunk_size", [1, 16, 1024])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.9), (0.7, 0.9), (1.3, 0.5)])
def test_top_p_equals_reference(chunk_size, temperature, top_p):
    _assert_matches_reference(chunk_size=chunk_size, temperature=temperature, top_p=top_p)


def test_top_p_is_vllms_nucleus_renormalised():
    """By hand on one row: the kept tokens are the fewest most likely ones whose mass exceeds
    top_p (vLLM's rule), renormalised; the target stays in even when outside the nucleus."""
    probs_V = torch.tensor([0.5, 0.3, 0.15, 0.05])
    hidden_1_H = torch.eye(4)[:1]  # logits = log probs through an identity LM head row
    lm_head_V_H = torch.zeros(4, 4)
    lm_head_V_H[:, 0] = probs_V.log()
    for target, top_p, want in [
        (0, 0.7, 0.5 / 0.8),  # nucleus {0, 1}: 0.5 + 0.3 = 0.8 > 0.7
        (1, 0.7, 0.3 / 0.8),
        (2, 0.7, 0.15 / 0.95),  # outside the nucleus: kept, with the nucleus (0.8 + 0.15)
        (0, 0.5, 1.0),  # 1 - 0.5 = 0.5 >= 0.05 + 0.15 + 0.3: only token 0 is left
        (2, 0.96, 0.15),  # 0.05 > 0.04: nothing is cut
    ]:
        logp_1, entropy_1 = selective_logprobs_entropy(
            hidden_1_H, lm_head_V_H, torch.tensor([target]), top_p=top_p
        )
        assert logp_1.exp().item() == pytest.approx(want, rel=1e-5), (target, top_p)
        assert torch.isfinite(entropy_1).all()


@pytest.mark.parametrize("use", ["lp", "ent"])
def test_one_output_in_the_loss(use):
    """Only one output feeds the loss: the other's gradient arrives as None and is skipped."""
    _assert_matches_reference(use=use, chunk_size=7, temperature=0.8)


def test_only_hidden_requires_grad():
    hidden_N_H, lm_head_V_H, targets_N, w_lp_N, _ = _inputs()
    lm_head_V_H = lm_head_V_H.detach()
    logprobs_N, _ = selective_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N, chunk_size=9)
    (w_lp_N * logprobs_N).sum().backward()
    got = hidden_N_H.grad.clone()
    hidden_N_H.grad = None
    logprobs_N, _ = reference_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N)
    (w_lp_N * logprobs_N).sum().backward()
    torch.testing.assert_close(got, hidden_N_H.grad, atol=1e-4, rtol=1e-5)


def test_bf16_inputs_give_fp32_outputs_and_input_dtype_grads():
    # On CPU both paths upcast to fp32; the grads differ only by their rounding to bf16.
    _assert_matches_reference(dtype=torch.bfloat16, chunk_size=13, temperature=0.9, tol=1.6e-2)


def test_logits_stay_fp32_under_autocast():
    hidden_N_H, lm_head_V_H, targets_N, w_lp_N, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs_N, entropy_N = selective_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N)
    want_lp_N, want_ent_N = reference_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N)
    torch.testing.assert_close(logprobs_N, want_lp_N, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy_N, want_ent_N, atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    hidden_N_H, lm_head_V_H, targets_N, _, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        selective_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        selective_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        selective_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N, top_p=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        selective_logprobs_entropy(hidden_N_H, lm_head_V_H[:, :-1], targets_N)


def test_cpu_dispatches_to_torch_row_ops():
    assert isinstance(lp_mod._row_ops_for(torch.zeros(1, 1)), lp_mod.TorchRowOps)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_triton_kernels_under_the_interpreter():
    """Reruns the `interpreted` tests below in a fresh process with TRITON_INTERPRET=1.

    The variable must be set before triton is first imported, which this process cannot promise.
    """
    pytest.importorskip("triton")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "interpreted",
        ],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.fixture
def interpreted_triton_row_ops(monkeypatch):
    """Triton row ops whose kernels run in the interpreter, with tiles of 32 columns."""
    if not INTERPRETED:
        pytest.skip("runs in test_triton_kernels_under_the_interpreter's subprocess")
    from rollflow.gpu_kernels import triton_logprobs

    # V=97 then spans four tiles, the last one partly masked: exercises the online rescaling.
    monkeypatch.setattr(triton_logprobs, "MAX_BLOCK_V", 32)
    return triton_logprobs.TritonRowOps()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_interpreted_triton_kernels_equal_reference(interpreted_triton_row_ops, temperature):
    _assert_matches_reference(
        chunk_size=16, temperature=temperature, row_ops=interpreted_triton_row_ops
    )


def test_interpreted_triton_kernels_with_top_p(interpreted_triton_row_ops):
    _assert_matches_reference(
        chunk_size=16, temperature=0.7, top_p=0.9, row_ops=interpreted_triton_row_ops
    )


@pytest.mark.parametrize("use", ["lp", "ent"])
def test_interpreted_triton_kernels_one_output(interpreted_triton_row_ops, use):
    _assert_matches_reference(use=use, chunk_size=16, row_ops=interpreted_triton_row_ops)
