"""The compute commands as every rank runs them: forward, forward/backward, optimizer step.

Owns: the two phases of a command that reads a batch. 1. prepare (local): read the batch, check
it, pack this rank's micro-batches (``batches.BatchReader``); the ranks then exchange a status
(``agree``), and if any rank found bad input, every rank raises ``InputError`` together, before
any model collective, so the service stays usable. 2. compute (collective): forward / backward /
step / gather, identical on every rank; rank 0 merges the ranks' figures into the answer.

An exception in phase 2 leaves the ranks out of step: the service treats it as fatal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollflow.infra.errors import InputError, StorageError
from rollflow.infra.moments import PerEnvMoments
from rollflow.trainer.batches import BatchReader
from rollflow.trainer.control import ControlGroup
from rollflow.trainer.losses import ratio_quantiles
from rollflow.trainer.metrics import effective_sample_size
from rollflow.trainer.packing import PackedBatch
from rollflow.trainer.protocol import BatchRef, ForwardBackward
from rollflow.trainer.rank_trainer import SUM_KEYS, Trainer, add_counts


def agree(control: ControlGroup, prepare: Callable[[], Any]) -> list[Any]:
    """Run ``prepare`` here, exchange outcomes; raise ``InputError`` on every rank if any failed.
    Every rank's result, in rank order."""
    try:
        mine = {"ok": prepare()}
    except (InputError, StorageError, ValueError, KeyError, OSError) as err:
        mine = {"error": f"rank {control.rank}: {err}"}
    everyone = control.all_gather(mine)
    errors = [o["error"] for o in everyone if "error" in o]
    if errors:
        raise InputError(errors[0])
    return [o["ok"] for o in everyone]


class StepOps:
    """One rank's side of the commands that train: each is a collective on every rank; rank 0
    answers with the merged figures, the other ranks with ``{}``."""

    def __init__(self, trainer: Trainer, control: ControlGroup, batches: BatchReader):
        self.trainer, self.control, self.batches = trainer, control, batches
        self.rank = control.rank

    def forward(self, req: BatchRef) -> dict:
        """Trainer log-probs of the batch's completions, written to ``logprobs/step=N`` (rank 0)."""
        start = time.perf_counter()
        mbs: list[PackedBatch] = []
        agree(
            self.control,
            lambda: mbs.extend(
                self.batches.my_micro_batches(
                    self.batches.sequences(req.step, req.group_indices, old_logprobs=False)
                )
            ),
        )
        mine = self.trainer.forward(mbs)
        everyone = self.control.all_gather([[list(k), lp] for k, lp in mine])
        if self.rank != 0:
            return {}
        rows = sorted((tuple(k), lp) for part in everyone for k, lp in part)
        uri = self.batches.write_logprobs(req.step, rows)
        return {"uri": uri, "num_sequences": len(rows), "forward_s": time.perf_counter() - start}

    def forward_backward(self, req: ForwardBackward) -> dict:
        start = time.perf_counter()
        mbs: list[PackedBatch] = []

        def prepare() -> int:
            seqs = self.batches.sequences(
                req.step, req.group_indices, req.old_logprobs == "trainer", req.samples
            )
            mbs.extend(self.batches.my_micro_batches(seqs))
            return sum(s.num_loss_tokens for mb in mbs for s in mb.sequences)

        # The global loss-token count: each rank's count, summed over ranks (the all-gather in
        # ``agree`` is the all-reduce).
        tokens = sum(agree(self.control, prepare))
        # No loss token (rows of environment tokens only): a zero loss, divided by 1.
        denominator = req.num_loss_tokens or max(tokens, 1)
        mine = self.trainer.forward_backward(mbs, req.loss, denominator)
        everyone = self.control.all_gather(mine)
        if self.rank != 0:
            return {}
        return merge_forward_backward(everyone, denominator, time.perf_counter() - start)

    def optim_step(self, _: None = None) -> dict:
        try:
            return self.trainer.optim_step()
        except RuntimeError as err:  # the same on every rank: no gradients anywhere
            if "without forward_backward" in str(err):
                raise InputError(str(err)) from None
            raise


def merge_forward_backward(parts: list[dict], denominator: float, elapsed_s: float) -> dict:
    """The ranks' forward/backward figures as one answer: token means over all ranks."""
    sums = {k: sum(p["sums"][k] for p in parts) for k in SUM_KEYS}
    per_env = PerEnvMoments()
    hist: list[float] = []
    for p in parts:
        per_env.merge_json(p["per_env"])
        hist = add_counts(hist, p.get("is_hist") or [])
    n = max(sums["num_loss_tokens"], 1)
    q05, q50, q95 = ratio_quantiles(hist)
    return {
        "loss": sums["loss_sum"] / denominator,
        "pg_loss": sums["pg_loss_sum"] / denominator,
        "num_loss_tokens": int(sums["num_loss_tokens"]),
        "num_tokens": int(sums["num_tokens"]),
        "clip_fraction": sums["clipped_tokens"] / n,
        "entropy": sums["entropy_sum"] / n,
        "mismatch_kl": sums["mismatch_kl_sum"] / n,
        "kl": sums["kl_sum"] / n,
        "tis_weight": sums["tis_weight_sum"] / n,
        "is_masked_fraction": sums["is_masked_tokens"] / n,
        "is_ratio_q05": q05,
        "is_ratio_q50": q50,
        "is_ratio_q95": q95,
        "ess": effective_sample_size(sums["is_weight_sum"], sums["is_weight_sq_sum"], n),
        "per_env": per_env.to_json(),
        "forward_backward_s": elapsed_s,
    }
