"""Triton row kernels for `selective_logprobs_entropy` on CUDA.

Imported only from the CUDA branch of `logprobs._row_ops_for` (and by tests, which run the kernels
under the Triton interpreter on CPU): importing this module imports `triton`.

One program handles one row of a chunk of raw logits (fp32, C x V) and streams it in BLOCK_V
tiles, so a row of any vocabulary size needs no more than a tile of registers:

- forward: an online log-sum-exp (running max m, running sum s of exp(z - m)) together with the
  running sum a of exp(z - m) * (z - m), rescaled and shifted whenever m grows;
  entropy = log s - a / s.
- backward: recomputes p = exp(z - lse) tile by tile and writes the gradient w.r.t. the raw logits
  over the logits buffer, so the chunk needs a single C x V buffer in backward.

The matmuls around these kernels stay in cuBLAS (see `logprobs._mm_fp32`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A tile of 4096 fp32 values is 16 KiB per row: large enough to hide load latency, small enough
# to stay in registers with 8 warps.
MAX_BLOCK_V = 4096


@triton.jit
def _rows_forward_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    m = -float("inf")
    s = 0.0
    a = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        z = z * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        rescale = tl.exp(m - m_new)
        z_shifted = tl.where(mask, z - m_new, 0.0)  # finite on masked lanes too
        e = tl.where(mask, tl.exp(z_shifted), 0.0)
        # a holds sum e * (z - m), relative to the running max: moving the max to m_new shifts
        # every earlier term by (m - m_new). Before the first tile s == 0 and m == -inf.
        m_old = tl.where(s > 0.0, m, m_new)
        a = (a + s * (m_old - m_new)) * rescale + tl.sum(e * z_shifted, axis=0)
        s = s * rescale + tl.sum(e, axis=0)
        m = m_new
    # entropy = lse - E[z] = log s - E[z - m]: two O(log V) terms, no cancellation of large logits.
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row)
    z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
    tl.store(logprobs_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, log_s - a / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _rows_backward_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    V,
    inv_temperature,
    HAS_GRAD_LOGPROBS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    target = tl.load(targets_ptr + row)
    g_lp = 0.0
    g_ent = 0.0
    if HAS_GRAD_LOGPROBS:
        g_lp = tl.load(grad_logprobs_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        logp = z - lse
        p = tl.exp(logp)
        # g_lp * (onehot(t) - p) - g_ent * p * (log p + entropy), then d z / d raw = 1 / T.
        grad = -g_lp * p - g_ent * p * (logp + entropy)
        grad = tl.where(cols == target, grad + g_lp, grad) * inv_temperature
        tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _block_v(vocab_size: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab_size))


class TritonRowOps:
    """`logprobs.RowOps` on Triton kernels; logits rows must be contiguous (stride 1 along V)."""

    def forward(self, logits_C_V, targets_C, temperature):
        num_rows, vocab_size = logits_C_V.shape
        assert logits_C_V.stride(1) == 1
        logprobs_C = torch.empty(num_rows, dtype=torch.float32, device=logits_C_V.device)
        entropy_C = torch.empty_like(logprobs_C)
        lse_C = torch.empty_like(logprobs_C)
        if num_rows == 0:
            return logprobs_C, entropy_C, lse_C
        _rows_forward_kernel[(num_rows,)](
            logits_C_V,
            logits_C_V.stride(0),
            targets_C.contiguous(),
            logprobs_C,
            entropy_C,
            lse_C,
            vocab_size,
            1.0 / temperature,
            BLOCK_V=_block_v(vocab_size),
            num_warps=8,
        )
        return logprobs_C, entropy_C, lse_C

    def backward_(
        self, logits_C_V, targets_C, lse_C, entropy_C, grad_logprobs_C, grad_entropy_C, temperature
    ):
        num_rows, vocab_size = logits_C_V.shape
        assert logits_C_V.stride(1) == 1
        if num_rows == 0:
            return logits_C_V
        # An unused pointer still needs a tensor; the constexpr flags keep it from being read.
        placeholder = lse_C
        _rows_backward_kernel[(num_rows,)](
            logits_C_V,
            logits_C_V.stride(0),
            targets_C.contiguous(),
            lse_C.contiguous(),
            entropy_C.contiguous(),
            placeholder if grad_logprobs_C is None else grad_logprobs_C.contiguous(),
            placeholder if grad_entropy_C is None else grad_entropy_C.contiguous(),
            vocab_size,
            1.0 / temperature,
            HAS_GRAD_LOGPROBS=grad_logprobs_C is not None,
            HAS_GRAD_ENTROPY=grad_entropy_C is not None,
            BLOCK_V=_block_v(vocab_size),
            num_warps=8,
        )
        return logits_C_V
