"""Dispatch and packing: which rank trains which sequence, and how each rank packs its share.

A batch reaches every rank as the same list of sequences (each rank reads the batch's Parquet
itself), so every rank computes the same plan without talking to the others:

1. ``split_across_ranks``: sequences are dealt to data-parallel ranks, longest first, each to the
   rank with the fewest tokens so far (balanced by tokens).
2. ``plan_micro_batches``: each rank cuts its share into micro-batches of at most
   ``micro_batch_tokens`` real tokens (a longer sequence gets a micro-batch of its own: a
   sequence is never split, GSPO's ratio is per sequence). Every rank then gets the SAME number of
   micro-batches, the largest count of any rank, padding with empty ones: FSDP and ZeRO run
   collectives in every forward and backward, so ranks must run equally many.
3. ``pack``: a micro-batch's sequences are concatenated, padding-free, into rows of at most
   ``row_tokens`` tokens (first fit, longest first), with ``position_ids`` restarting at 0 for each
   sequence. Hugging Face models (transformers >= 4.5x) read restarting ``position_ids`` with no
   attention mask as packed sequences: sdpa/eager attention build a block-diagonal causal mask,
   flash-attention runs varlen kernels. On CPU rows are kept short (attention costs rows x
   row_tokens^2); ``row_tokens=None`` packs one row per micro-batch (flash-attention on GPU).

Invariants: every sequence lands in exactly one micro-batch of exactly one rank; ranks hold equally
many micro-batches; within a row, attention never crosses a sequence boundary; the packed loss
tokens are exactly the completion tokens, each predicted from the hidden state before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sequence:
    """One completion of the batch, as the trainer needs it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]
    advantage: float
    env: str = ""
    key: tuple[int, int] = (0, 0)  # (group_index, sample_index): names the row in outputs
    old_logprobs: list[float] | None = None  # the trainer's own, from an earlier `forward`
    # 1: the model's token (trained), 0: an environment's token (context only); None: all 1.
    loss_mask: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_loss_tokens(self) -> int:
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


def split_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices of the sequences each rank trains, balanced by tokens (longest first, to the lightest rank)."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(share) for share in shares]


def micro_batches(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequences whose summed length stays within ``budget`` tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in indices:
        if current and used + lengths[i] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


def plan_micro_batches(lengths: list[int], world_size: int, budget: int) -> list[list[list[int]]]:
    """``plan[rank][k]``: the sequence indices of rank ``rank``'s k-th micro-batch (maybe empty).

    All ranks get the same number of micro-batches, the largest any rank needs.
    """
    per_rank = [
        micro_batches(share, lengths, budget) for share in split_across_ranks(lengths, world_size)
    ]
    count = max(1, *(len(m) for m in per_rank))
    return [m + [[] for _ in range(count - len(m))] for m in per_rank]


@dataclass
class PackedBatch:
    """A micro-batch as tensors: packed rows in, per-loss-token gather indices and inputs.

    ``N`` is the number of completion tokens, ``B`` of sequences, ``T`` the longest
    completion; ``slot_N`` places completion token n at ``[n // T, n % T]`` of a [B, T] layout.
    ``loss_mask_N`` is 1 for the model's tokens and 0 for environment tokens of multi-turn
    episodes: those are context for the forward pass and in no loss, count or metric.
    """

    input_ids_R_P: torch.Tensor
    position_ids_R_P: torch.Tensor
    hidden_index_N: torch.Tensor  # flat index into the R*P hidden states that predict each token
    targets_N: torch.Tensor
    slot_N: torch.Tensor
    inference_logprobs_N: torch.Tensor
    old_logprobs_N: torch.Tensor | None
    advantages_B: torch.Tensor
    loss_mask_N: torch.Tensor
    num_seqs: int
    max_completion: int
    num_tokens: int  # real tokens (prompt + completion) in the rows
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0

    def to_B_T(self, x_N: torch.Tensor) -> torch.Tensor:
        """Scatter per-token values into the [B, T] layout of the loss (zeros elsewhere)."""
        flat = x_N.new_zeros(self.num_seqs * self.max_completion)
        return flat.index_copy(0, self.slot_N, x_N).view(self.num_seqs, self.max_completion)

    def mask_B_T(self) -> torch.Tensor:
        return self.to_B_T(self.loss_mask_N)

    def to(self, device: torch.device) -> PackedBatch:
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()
        }
        return PackedBatch(**moved)


def pack_rows(lengths: list[int], row_tokens: int | None) -> list[list[int]]:
    """First-fit-decreasing bins of at most ``row_tokens`` tokens (one bin if None)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if row_tokens is None:
        return [order]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max(row_tokens, lengths[i]) - lengths[i])
    return rows


def pack(sequences: list[Sequence], row_tokens: int | None) -> PackedBatch:
    """Concatenate ``sequences`` into padded-at-the-end rows; empty input gives a 2-token dummy row.

    The dummy keeps collectives in step on a rank with nothing to train; its loss is zero.
    """
    if not sequences:
        return _dummy()
    lengths = [s.num_tokens for s in sequences]
    rows = pack_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids_R_P = torch.zeros(len(rows), width, dtype=torch.long)
    # Padding gets its own run of positions, so it forms its own (ignored) segment.
    pos_R_P = torch.arange(width).repeat(len(rows), 1)
    T = max(len(s.completion_ids) for s in sequences)
    hidden_index, targets, slots, inference, old, mask = [], [], [], [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for b in row:
            s = sequences[b]
            p, c = len(s.prompt_ids), len(s.completion_ids)
            ids_R_P[r, offset : offset + p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
            pos_R_P[r, offset : offset + p + c] = torch.arange(p + c)
            if offset + p + c < width:
                pos_R_P[r, offset + p + c :] = torch.arange(width - offset - p - c)
            # Completion token j sits at offset+p+j and is predicted by the hidden state before it.
            start = r * width + offset + p - 1
            hidden_index.extend(range(start, start + c))
            targets.extend(s.completion_ids)
            slots.extend(range(b * T, b * T + c))
            inference.extend(s.inference_logprobs)
            mask.extend(s.loss_mask if s.loss_mask is not None else [1] * c)
            if s.old_logprobs is not None:
                old.extend(s.old_logprobs)
            offset += p + c
    has_old = all(s.old_logprobs is not None for s in sequences)
    return PackedBatch(
        input_ids_R_P=ids_R_P,
        position_ids_R_P=pos_R_P,
        hidden_index_N=torch.tensor(hidden_index, dtype=torch.long),
        targets_N=torch.tensor(targets, dtype=torch.long),
        slot_N=torch.tensor(slots, dtype=torch.long),
        inference_logprobs_N=torch.tensor(inference, dtype=torch.float32),
        old_logprobs_N=torch.tensor(old, dtype=torch.float32) if has_old else None,
        advantages_B=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        loss_mask_N=torch.tensor(mask, dtype=torch.float32),
        num_seqs=len(sequences),
        max_completion=T,
        num_tokens=sum(lengths),
        sequences=list(sequences),
    )


def _dummy() -> PackedBatch:
    return PackedBatch(
        input_ids_R_P=torch.zeros(1, 2, dtype=torch.long),
        position_ids_R_P=torch.arange(2)[None],
        hidden_index_N=torch.zeros(1, dtype=torch.long),
        targets_N=torch.zeros(1, dtype=torch.long),
        slot_N=torch.zeros(1, dtype=torch.long),
        inference_logprobs_N=torch.zeros(1),
        old_logprobs_N=None,
        advantages_B=torch.zeros(1),
        loss_mask_N=torch.zeros(1),
        num_seqs=0,
        max_completion=1,
        num_tokens=0,
    )
