"""Log-probabilities of the sampled tokens and per-position entropy, computed in chunks of tokens.

With hidden states h (N x H), LM head W (V x H), targets t (N) and temperature T, the logits are
z = h W^T / T and, per position,

    logprob = z[t] - lse(z)            entropy = lse(z) - sum_v p_v z_v,   p = softmax(z)

The naive computation holds several fp32 N x V tensors at once (logits, log-softmax, softmax and
their gradients). `selective_logprobs_entropy` walks the tokens in chunks of `chunk_size` rows and
holds at most two fp32 chunk_size x V buffers at a time; the backward pass recomputes each chunk's
logits instead of saving them and accumulates the gradients of h and W chunk by chunk. What it keeps
between forward and backward is O(N): the log-sum-exp and the entropy of each row.

Gradients, per row, with respect to z (then divided by T for the raw logits h W^T):

    d logprob / dz = onehot(t) - p     d entropy / dz = -p * (log p + entropy)

Both outputs carry gradients, so an entropy bonus in the loss trains the model.

Top-p (nucleus) with `top_p < 1`: the distribution is the one vLLM samples from and returns with
`--logprobs-mode processed_logprobs`: tempered, then cut to the nucleus and renormalised. The
nucleus follows vLLM's rule (`apply_top_k_top_p`): sort the tempered probabilities in ascending
order and drop every token whose cumulative sum is <= 1 - top_p, always keeping the most likely
one. The target token is always kept as well (the sampler drew it from its nucleus; with moved
weights the trainer's nucleus may no longer hold it, and a log-prob of -inf would make every ratio
0 and every metric infinite). Dropped logits are set to a large negative finite value before the
row operations (`nucleus_mask_`), so p = 0 and p log p = 0 there with no NaN, and the Triton and
torch row operations run unchanged. The mask is recomputed in backward from the recomputed
logits; it is piecewise constant, so no gradient flows through its choice (as in every RL
framework that trains on processed log-probs). Cost: one sort of a chunk (values + int64
indices: about 3 more chunk_size x V buffers at peak), only when top_p < 1.

Dispatch: on CUDA with `triton` importable, the per-row statistics and the gradient of the
logits run in Triton kernels (`triton_logprobs`) and the chunk matmuls in cuBLAS with fp32 output.
Everywhere else the same chunk loop runs with torch row operations. Autocast is switched off inside
(the logits stay fp32 whatever the caller's autocast says).

Memory: about 2 x chunk_size x V x 4 bytes of chunk buffers (1024 rows of a 128k vocabulary: 1 GiB),
plus the fp32 V x H gradient of W. On CUDA with half-precision inputs the backward also casts the
chunk's gradient to that dtype for cuBLAS (one more chunk_size x V buffer at half the size).

Invariant: the outputs and the gradients of h and W equal `reference_logprobs_entropy`'s to fp32
tolerance for every chunk_size >= 1, temperature > 0 and 0 < top_p <= 1; without top-p no
fp32 tensor larger than chunk_size x V is allocated besides the fp32 gradient of W (V x H).
"""

from __future__ import annotations

from typing import Protocol

import torch

DEFAULT_CHUNK_SIZE = 1024
# Written over raw logits outside the nucleus: exp() of it is 0 after any temperature > 1e-8, and it
# stays finite after division by the temperature (fp32 max 3.4e38), so 0 * logit is 0, never NaN.
MASKED_LOGIT = -1e30


def nucleus_mask_(
    logits_C_V: torch.Tensor, targets_C: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """Write MASKED_LOGIT over the raw logits outside each row's top-p nucleus (in place).

    The nucleus is vLLM's (see the module docstring), computed on logits / temperature; each
    row's target stays in it. Returns ``logits_C_V``.
    """
    if top_p >= 1.0 or logits_C_V.shape[0] == 0:
        return logits_C_V
    sorted_C_V, order_C_V = logits_C_V.sort(dim=-1)  # ascending, as vLLM
    cumulative_C_V = (sorted_C_V / temperature).softmax(dim=-1).cumsum_(dim=-1)
    drop_sorted_C_V = cumulative_C_V <= 1.0 - top_p
    drop_sorted_C_V[:, -1] = False  # the most likely token always stays
    del sorted_C_V, cumulative_C_V
    drop_C_V = torch.empty_like(drop_sorted_C_V).scatter_(-1, order_C_V, drop_sorted_C_V)
    drop_C_V.scatter_(-1, targets_C.unsqueeze(-1), False)
    return logits_C_V.masked_fill_(drop_C_V, MASKED_LOGIT)


class RowOps(Protocol):
    """The two per-row operations on a chunk of raw logits (h W^T, fp32, C x V)."""

    def forward(
        self, logits_C_V: torch.Tensor, targets_C: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (logprobs_C, entropy_C, lse_C) of logits / temperature; may overwrite logits."""
        ...

    def backward_(
        self,
        logits_C_V: torch.Tensor,
        targets_C: torch.Tensor,
        lse_C: torch.Tensor,
        entropy_C: torch.Tensor,
        grad_logprobs_C: torch.Tensor | None,
        grad_entropy_C: torch.Tensor | None,
        temperature: float,
    ) -> torch.Tensor:
        """Return the gradient w.r.t. the raw logits, written over `logits_C_V` in place."""
        ...


class TorchRowOps:
    """Row operations in plain torch, in place where possible: at most two C x V buffers."""

    def forward(self, logits_C_V, targets_C, temperature):
        # A hand-rolled log-sum-exp: torch.logsumexp allocates a third C x V buffer on CPU.
        shifted_C_V = logits_C_V.div_(temperature)
        max_C = shifted_C_V.amax(dim=-1)
        shifted_C_V.sub_(max_C.unsqueeze(-1))
        p_C_V = shifted_C_V.exp()
        sum_C = p_C_V.sum(dim=-1)
        logp_C_V = shifted_C_V.sub_(sum_C.log().unsqueeze(-1))
        p_C_V.div_(sum_C.unsqueeze(-1))
        logprobs_C = logp_C_V.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
        entropy_C = -p_C_V.mul_(logp_C_V).sum(dim=-1)  # in place: vecdot would allocate C x V
        return logprobs_C, entropy_C, max_C + sum_C.log()

    def backward_(
        self, logits_C_V, targets_C, lse_C, entropy_C, grad_logprobs_C, grad_entropy_C, temperature
    ):
        grad_C_V = logits_C_V.div_(temperature).sub_(lse_C.unsqueeze(-1))  # log p
        p_C_V = grad_C_V.exp()
        if grad_entropy_C is not None:
            # -g_ent * p * (log p + entropy)
            grad_C_V.add_(entropy_C.unsqueeze(-1)).mul_(p_C_V).mul_(-grad_entropy_C.unsqueeze(-1))
        else:
            grad_C_V.zero_()
        if grad_logprobs_C is not None:
            # g_lp * (onehot(t) - p)
            grad_C_V.addcmul_(p_C_V, grad_logprobs_C.unsqueeze(-1), value=-1.0)
            grad_C_V.scatter_add_(-1, targets_C.unsqueeze(-1), grad_logprobs_C.unsqueeze(-1))
        return grad_C_V.div_(temperature)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result, where `a` may be an fp32 gradient and `b` a half-precision weight.

    CUDA: the fp32 operand is cast down to the other's dtype and cuBLAS accumulates in fp32 (the
    usual mixed-precision trade). CPU: both are upcast, which copies W to fp32 per chunk (time, not
    peak memory beyond V x H) and keeps the CPU path exact against the reference.
    """
    if a.dtype == b.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        half = b.dtype if b.dtype != torch.float32 else a.dtype
        return torch.mm(a.to(half), b.to(half), out_dtype=torch.float32)
    return a.float() @ b.float()


def _add_mm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b into an fp32 accumulator, without a temporary when everything is fp32."""
    if a.dtype == b.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        acc += _mm_fp32(a, b)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_N_H, lm_head_V_H, targets_N, chunk_size, temperature, top_p, row_ops):
        with torch.autocast(hidden_N_H.device.type, enabled=False):
            return _ChunkedLogprobsEntropy._forward(
                ctx, hidden_N_H, lm_head_V_H, targets_N, chunk_size, temperature, top_p, row_ops
            )

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        with torch.autocast(ctx.device_type, enabled=False):
            return _ChunkedLogprobsEntropy._backward(ctx, grad_logprobs_N, grad_entropy_N)

    @staticmethod
    def _forward(ctx, hidden_N_H, lm_head_V_H, targets_N, chunk_size, temperature, top_p, row_ops):
        num_tokens = hidden_N_H.shape[0]
        logprobs_N = hidden_N_H.new_empty(num_tokens, dtype=torch.float32)
        entropy_N = torch.empty_like(logprobs_N)
        lse_N = torch.empty_like(logprobs_N)
        weight_H_V = lm_head_V_H.t()
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, num_tokens))
            logits_C_V = _mm_fp32(hidden_N_H[rows], weight_H_V)
            nucleus_mask_(logits_C_V, targets_N[rows], temperature, top_p)
            logprobs_N[rows], entropy_N[rows], lse_N[rows] = row_ops.forward(
                logits_C_V, targets_N[rows], temperature
            )
            del logits_C_V
        ctx.save_for_backward(hidden_N_H, lm_head_V_H, targets_N, lse_N, entropy_N)
        ctx.chunk_size, ctx.temperature, ctx.top_p = chunk_size, temperature, top_p
        ctx.row_ops = row_ops
        ctx.device_type = hidden_N_H.device.type
        ctx.set_materialize_grads(False)
        return logprobs_N, entropy_N

    @staticmethod
    def _backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_N_H, lm_head_V_H, targets_N, lse_N, entropy_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs_N is None and grad_entropy_N is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        num_tokens = hidden_N_H.shape[0]
        grad_hidden_N_H = torch.empty_like(hidden_N_H) if need_hidden else None
        # fp32 accumulator across chunks; cast to W's dtype once at the end.
        grad_weight_V_H = (
            torch.zeros(lm_head_V_H.shape, dtype=torch.float32, device=lm_head_V_H.device)
            if need_weight
            else None
        )
        weight_H_V = lm_head_V_H.t()
        for start in range(0, num_tokens, ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, num_tokens))
            hidden_C_H = hidden_N_H[rows]
            logits_C_V = _mm_fp32(hidden_C_H, weight_H_V)
            nucleus_mask_(logits_C_V, targets_N[rows], ctx.temperature, ctx.top_p)
            grad_C_V = ctx.row_ops.backward_(
                logits_C_V,
                targets_N[rows],
                lse_N[rows],
                entropy_N[rows],
                None if grad_logprobs_N is None else grad_logprobs_N[rows].float(),
                None if grad_entropy_N is None else grad_entropy_N[rows].float(),
                ctx.temperature,
            )
            if grad_hidden_N_H is not None:
                grad_hidden_N_H[rows] = _mm_fp32(grad_C_V, lm_head_V_H)
            if grad_weight_V_H is not None:
                _add_mm_fp32_(grad_weight_V_H, grad_C_V.t(), hidden_C_H)
            del logits_C_V, grad_C_V
        if grad_weight_V_H is not None:
            grad_weight_V_H = grad_weight_V_H.to(lm_head_V_H.dtype)
        return grad_hidden_N_H, grad_weight_V_H, None, None, None, None, None


def _row_ops_for(hidden_N_H: torch.Tensor) -> RowOps:
    """Triton on CUDA when it imports, torch otherwise."""
    if hidden_N_H.is_cuda:
        try:
            from rollflow.gpu_kernels.triton_logprobs import TritonRowOps
        except ImportError:
            return TorchRowOps()
        return TritonRowOps()
    return TorchRowOps()


def selective_logprobs_entropy(
    hidden_N_H: torch.Tensor,
    lm_head_V_H: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    top_p: float = 1.0,
    row_ops: RowOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets_N` and entropy at each position, fp32, without N x V logits.

    Peak extra memory is about two fp32 chunk_size x V buffers plus, in backward, an fp32 V x H
    gradient accumulator for the LM head; smaller chunks cost time only through more, smaller
    matmuls. Both outputs are differentiable w.r.t. `hidden_N_H` and
    `lm_head_V_H`. `targets_N` must lie in [0, V): mask ignored positions (prompt, padding) after
    the call, not with a sentinel id. With `top_p < 1` both are of the nucleus distribution
    (see the module docstring). `row_ops` overrides the dispatch (tests use it).
    """
    if hidden_N_H.dim() != 2 or lm_head_V_H.dim() != 2 or targets_N.dim() != 1:
        raise ValueError("expected hidden [N, H], lm_head [V, H] and targets [N]")
    if hidden_N_H.shape[1] != lm_head_V_H.shape[1] or hidden_N_H.shape[0] != targets_N.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden_N_H.shape)}, lm_head {tuple(lm_head_V_H.shape)},"
            f" targets {tuple(targets_N.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    row_ops = row_ops if row_ops is not None else _row_ops_for(hidden_N_H)
    return _ChunkedLogprobsEntropy.apply(
        hidden_N_H,
        lm_head_V_H,
        targets_N.long(),
        chunk_size,
        float(temperature),
        float(top_p),
        row_ops,
    )


def reference_logprobs_entropy(
    hidden_N_H: torch.Tensor,
    lm_head_V_H: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantities from full fp32 N x V logits and torch autograd: the definition.

    The nucleus is computed as vLLM does, with -inf outside it (entropy terms there are 0).
    """
    logits_N_V = (hidden_N_H.float() @ lm_head_V_H.float().t()) / temperature
    if top_p < 1.0:
        with torch.no_grad():
            sorted_N_V, order_N_V = logits_N_V.sort(dim=-1)
            drop_sorted = sorted_N_V.softmax(-1).cumsum(-1) <= 1.0 - top_p
            drop_sorted[:, -1] = False
            drop_N_V = torch.zeros_like(drop_sorted).scatter(-1, order_N_V, drop_sorted)
            drop_N_V[torch.arange(len(targets_N)), targets_N.long()] = False
        logits_N_V = logits_N_V.masked_fill(drop_N_V, -float("inf"))
    logp_N_V = torch.log_softmax(logits_N_V, dim=-1)
    logprobs_N = logp_N_V.gather(-1, targets_N.long().unsqueeze(-1)).squeeze(-1)
    p_N_V = logp_N_V.exp()
    entropy_N = -(p_N_V * logp_N_V.masked_fill(p_N_V == 0, 0.0)).sum(-1)
    return logprobs_N, entropy_N
