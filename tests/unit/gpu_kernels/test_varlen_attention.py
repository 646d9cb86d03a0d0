"""Packed rows on GPU attend per sequence without a dense mask (issue 26, item 10).

The CUDA kernel itself runs only on a GPU (bench/device_check.py's ``attention`` row compares it
with the dense mask there); here the same function runs its per-sequence path, and the choice of
attention for a CUDA device is checked as the pure function it is.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

from rollflow.gpu_kernels import varlen_attention
from rollflow.trainer import policy
from rollflow.trainer.packing import Sequence, pack


def _model(kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def _packed(lengths_per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(sum(row) for row in lengths_per_row)
    ids = torch.randint(0, 50, (len(lengths_per_row), width))
    pos = torch.arange(width).repeat(len(lengths_per_row), 1)
    for r, row in enumerate(lengths_per_row):
        offset = 0
        for n in [
            *row,
            width - sum(row),
        ]:  # the padding is a segment of its own, as pack() makes it
            pos[r, offset : offset + n] = torch.arange(n)
            offset += n
    return ids, pos


def test_cu_seqlens_starts_each_sequence_and_each_row():
    _, pos = _packed([[3, 5], [4]])  # row 1 padded by 4
    cu, longest = varlen_attention.cu_seqlens(pos)
    assert cu.tolist() == [0, 3, 8, 12, 16]
    assert cu.dtype == torch.int32 and longest == 5
    # A row whose first sequence continues from the previous row still starts a segment.
    cu, _ = varlen_attention.cu_seqlens(torch.tensor([[0, 1, 2], [3, 4, 0]]))
    assert cu.tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_varlen_equals_transformers_packed_sdpa(kv_heads):
    model = _model(kv_heads)
    ids, pos = _packed([[7, 12, 3], [20, 5]])
    model.set_attn_implementation("sdpa")
    want = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    model.set_attn_implementation(varlen_attention.register())
    got = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # And each sequence as if alone: no attention across a boundary.
    alone = model.model(
        input_ids=ids[:1, 7:19], position_ids=torch.arange(12)[None], use_cache=False
    ).last_hidden_state
    torch.testing.assert_close(got[:1, 7:19], alone, atol=1e-5, rtol=1e-5)


def test_varlen_builds_no_dense_mask():
    model = _model()
    ids, pos = _packed([[30, 30]])
    embeds = model.model.embed_tokens(ids)
    model.set_attn_implementation("sdpa")
    dense = create_causal_mask(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=pos,
    )
    assert dense is not None and dense.shape[-2:] == (60, 60)  # what sdpa would allocate
    model.set_attn_implementation(varlen_attention.register())
    assert (
        create_causal_mask(
            config=model.config,
            inputs_embeds=embeds,
            attention_mask=None,
            past_key_values=None,
            position_ids=pos,
        )
        is None
    )


def test_packed_policy_logprobs_and_gradients_match_sdpa(tiny_model_dir):
    """The trainer's own forward: the same log-probs and gradients under either attention."""
    seqs = [
        Sequence(
            prompt_ids=[1, 5, 6],
            completion_ids=[7, 8, 2],
            inference_logprobs=[-1.0] * 3,
            advantage=1.0,
        ),
        Sequence(
            prompt_ids=[1, 9],
            completion_ids=[10, 11, 12, 2],
            inference_logprobs=[-1.0] * 4,
            advantage=-1.0,
        ),
    ]
    mb = pack(seqs, None)
    results = []
    for attention in ("sdpa", varlen_attention.register()):
        hf = policy.load_hf_model(tiny_model_dir, torch.device("cpu"))
        hf.set_attn_implementation(attention)
        packed = policy.PackedPolicy(hf)
        logp, _ = packed(mb.input_ids_R_P, mb.position_ids_R_P, mb.hidden_index_N, mb.targets_N)
        logp.sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in packed.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_cuda_never_gets_a_dense_mask(monkeypatch):
    """Without flash_attn a CUDA trainer runs the varlen attention, not sdpa's [P, P] mask."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails, as on the lent image
    assert policy.attention_implementation(torch.device("cuda", 0)) == varlen_attention.NAME
    assert policy.attention_implementation(torch.device("cpu")) == "sdpa"


def test_varlen_refuses_a_model_that_passes_no_positions():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="needs position_ids"):
        varlen_attention.varlen_attention_forward(None, q, q, q, None)
