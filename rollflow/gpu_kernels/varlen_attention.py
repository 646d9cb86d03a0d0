"""Attention over packed rows without a dense mask: each sequence attends only to itself.

The trainer packs several sequences into one row, ``position_ids`` restarting at 0 for each (see
``trainer/packing.py``). transformers' ``sdpa`` path turns that into a dense ``[P, P]`` mask per
row: 1 GiB of booleans at 32k tokens, and attention work quadratic in the ROW length, most of it
across sequences and then masked away, with no flash kernel (flash takes no mask). Without the
``flash_attn`` package that is what a GPU trainer ran.

This module registers the attention implementation ``"rollflow_varlen"`` with transformers. It
reads the sequence boundaries from ``position_ids`` (a sequence starts where its position is 0,
and every row starts one) and runs

- on CUDA in bf16/fp16: torch's variable-length flash attention (``varlen_attn`` over
  ``cu_seqlens``), causal within each sequence, work linear in the number of sequences;
- elsewhere: ``scaled_dot_product_attention`` once per sequence, causal: the same math.

Its mask function returns ``None``, so no dense mask is ever built.

Invariant: the output equals transformers' packed ``sdpa`` output (a block-diagonal causal mask)
up to kernel rounding; a token never attends across a sequence boundary.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

NAME = "rollflow_varlen"


def cu_seqlens(position_ids_R_P: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts (int32, ``S + 1``) of the flattened rows, and the longest."""
    R, P = position_ids_R_P.shape
    flat = position_ids_R_P.reshape(-1)
    is_start = flat == 0
    is_start[::P] = True  # a row always starts a sequence
    starts = torch.nonzero(is_start).flatten()
    cu = torch.cat([starts, starts.new_tensor([R * P])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def torch_varlen() -> Callable | None:
    """torch's varlen flash attention, where this torch has it (2.9+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _causal_kwargs(fn: Callable) -> dict:
    # torch 2.9-2.11 take is_causal; later releases a flash-style window, (-1, 0) being causal.
    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        return {"is_causal": True}
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    raise RuntimeError(
        f"torch {torch.__version__}'s varlen_attn takes neither is_causal nor window_size"
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: q ``[R, Hq, P, D]``, k/v ``[R, Hkv, P, D]``
    in; ``[R, P, Hq, D]`` out."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(
            f"{NAME} attention needs position_ids (packed rows); this model's attention layer "
            "does not pass them on: use attn_implementation='sdpa'"
        )
    if attention_mask is not None:
        raise RuntimeError(f"{NAME} attention reads boundaries from position_ids; got a mask too")
    R, Hq, P, D = query.shape
    groups = Hq // key.shape[1]
    if groups > 1:  # grouped-query attention: one kv head per group of query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    cu, longest = cu_seqlens(position_ids.to(query.device))
    q, k, v = (x.transpose(1, 2).reshape(R * P, Hq, D) for x in (query, key, value))
    fn = torch_varlen()
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and fn is not None:
        out = fn(q, k, v, cu, cu, longest, longest, scale=scaling, **_causal_kwargs(fn))
    else:
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            # [H, L, D] per sequence; sdpa's causal mask is the sequence's own.
            seg = [x[start:end].transpose(0, 1) for x in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(
                *seg, is_causal=True, scale=scaling
            ).transpose(0, 1)
    return out.reshape(R, P, Hq, D), None


def _no_mask(*args, **kwargs) -> None:
    return None


def register() -> str:
    """Make ``attn_implementation=NAME`` known to transformers (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
