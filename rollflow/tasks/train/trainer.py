"""The policy and its optimizer: forward_backward, optim_step, checkpoints.

This class is what the trainer service holds for the life of a run. It knows nothing of
mini-batches or epochs (the train task owns the algorithm); it accumulates gradients over
whatever rows it is given until ``optim_step``.

Invariant: after ``forward_backward`` calls covering rows R and one ``optim_step``, the update
equals one step on the mean per-token loss over all loss tokens of R, whatever the micro-batch
split (each micro-batch's summed loss is divided by the total token count passed in).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflow.tasks.train.losses import ppo_clip_loss, sequence_logprobs


class Trainer:
    """One rank's model + AdamW."""

    def __init__(self, model_path: str | Path, *, lr: float, weight_decay: float, max_grad_norm: float,
                 micro_batch_tokens: int, seed: int = 0):
        torch.manual_seed(seed)
        self.model_path = Path(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.step = 0  # optimizer steps taken
        self._pending_tokens = 0

    # ---------------------------------------------------------------- training

    def forward_backward(self, rows: list[dict[str, Any]], *, total_loss_tokens: int, eps_low: float,
                         eps_high: float) -> dict[str, float]:
        """Accumulate gradients of the PPO-clip loss over ``rows``, scaled by 1/total_loss_tokens."""
        totals = {"loss_sum": 0.0, "num_tokens": 0, "clipped": 0.0, "ratio": 0.0, "mismatch_kl": 0.0,
                  "entropy_proxy": 0.0}
        start = time.perf_counter()
        for micro in self._micro_batches(rows):
            ids, attn, old, mask, adv = _collate(micro)
            logp = sequence_logprobs(self.model, ids, attn)
            out = ppo_clip_loss(logp, old, adv, mask, eps_low, eps_high)
            (out.loss_sum / total_loss_tokens).backward()
            totals["loss_sum"] += out.loss_sum.detach().item()
            totals["num_tokens"] += out.num_tokens
            totals["clipped"] += out.clipped_tokens
            totals["ratio"] += out.ratio_sum
            totals["mismatch_kl"] += out.mismatch_kl_sum
            totals["entropy_proxy"] += float(-(logp.detach() * mask).sum())
        self._pending_tokens += totals["num_tokens"]
        n = max(totals["num_tokens"], 1)
        return {
            "loss": totals["loss_sum"] / total_loss_tokens,
            "num_loss_tokens": totals["num_tokens"],
            "clip_fraction": totals["clipped"] / n,
            "ratio_mean": totals["ratio"] / n,
            "mismatch_kl": totals["mismatch_kl"] / n,
            "neg_logprob_mean": totals["entropy_proxy"] / n,
            "forward_backward_s": time.perf_counter() - start,
        }

    def optim_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients."""
        if self._pending_tokens == 0:
            raise RuntimeError("optim_step without forward_backward: no gradients accumulated")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._pending_tokens = 0
        return {"grad_norm": float(grad_norm), "optim_step": self.step}

    def _micro_batches(self, rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        """Consecutive rows whose padded size stays within the token budget."""
        batch: list[dict[str, Any]] = []
        longest = 0
        for row in rows:
            length = len(row["prompt_ids"]) + len(row["completion_ids"])
            if batch and max(longest, length) * (len(batch) + 1) > self.micro_batch_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(row)
            longest = max(longest, length)
        if batch:
            yield batch

    # ----------------------------------------------------------------- weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named parameters and buffers as vLLM loads them."""
        yield from self.model.state_dict().items()

    # ------------------------------------------------------------- checkpoints

    def save_checkpoint(self, folder: str | Path) -> Path:
        """HF safetensors + tokenizer, optimizer state (safetensors), trainer state (JSON)."""
        folder = Path(folder)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        self.model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        gen = self.model_path / "generation_config.json"
        if gen.exists():
            shutil.copy(gen, folder / "generation_config.json")
        names = {id(p): n for n, p in self.model.named_parameters()}
        tensors: dict[str, torch.Tensor] = {}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                tensors[f"{names[id(p)]}::{key}"] = torch.as_tensor(value).contiguous()
        tensors["rng::torch"] = torch.get_rng_state()
        # In a sub-folder: vLLM loads every *.safetensors at the top of a model directory.
        (folder / "trainer").mkdir()
        save_file(tensors, folder / "trainer" / "optimizer.safetensors")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        state = {"step": self.step, "param_groups": groups}
        (folder / "trainer" / "state.json").write_text(json.dumps(state, indent=2))
        return folder

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote (the model must already be loaded from it)."""
        folder = Path(folder)
        state = json.loads((folder / "trainer" / "state.json").read_text())
        tensors = load_file(folder / "trainer" / "optimizer.safetensors")
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            name, _, field = key.partition("::")
            if name == "rng":
                torch.set_rng_state(value)
                continue
            self.optimizer.state[params[name]][field] = value
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k in group})
        self.step = state["step"]


def _collate(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    """Right-padded token ids, attention mask, old logprobs, loss mask and advantages."""
    lengths = [len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows]
    T = max(lengths)
    ids_B_T = torch.zeros(len(rows), T, dtype=torch.long)
    attn_B_T = torch.zeros(len(rows), T, dtype=torch.long)
    old_B_T = torch.zeros(len(rows), T)
    mask_B_T = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        ids_B_T[i, : p + c] = torch.tensor(list(r["prompt_ids"]) + list(r["completion_ids"]))
        attn_B_T[i, : p + c] = 1
        old_B_T[i, p : p + c] = torch.tensor(r["completion_logprobs"], dtype=torch.float32)
        mask_B_T[i, p : p + c] = 1
    adv_B = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
    return ids_B_T, attn_B_T, old_B_T, mask_B_T, adv_B
