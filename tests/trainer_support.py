"""Shared by the trainer tests: batches with varied lengths, and an independent reference.

The reference computes what one process on the whole batch should get, the plain way: each
sequence alone through the HF model (no packing, no padding), full-vocabulary fp32 log-softmax,
``compute_loss`` per sequence, summed and divided by the batch's loss tokens, one backward.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rollflow.infra.config import LossConfig
from rollflow.infra.schema import rows_to_table
from rollflow.infra.storage import RunStorage
from rollflow.trainer.losses import LossInputs, compute_loss
from rollflow.trainer.packing import Sequence
from rollflow.trainer.protocol import ForwardBackwardReply, OptimStepReply


def one_process_group(tmp_path_factory) -> Iterator[None]:
    """A gloo group of one rank for this process, for a module's trainer-side code (use it as a
    module fixture's body: ``yield from one_process_group(tmp_path_factory)``)."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_rows(
    n: int,
    seed: int = 0,
    envs: tuple[str, ...] = ("sort", "add"),
    step: int = 1,
    max_prompt: int = 12,
    max_completion: int = 9,
    masked: bool = False,
) -> list[dict]:
    """Batch rows (the Parquet schema) with prompt and completion lengths that vary widely.

    ``masked``: every other row is a multi-turn episode whose middle tokens are an
    environment turn (mask 0, log-prob 0.0); one row is all environment tokens but its last.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        g, s = divmod(i, 4)
        prompt = [1] + [rng.randint(4, 40) for _ in range(rng.randint(1, max_prompt - 1))]
        completion = [rng.randint(4, 40) for _ in range(rng.randint(0, max_completion - 1))] + [2]
        rows.append(
            dict(
                run="t",
                step=step,
                env=envs[g % len(envs)],
                prompt_id=str(g),
                group_index=g,
                sample_index=s,
                prompt_text="",
                completion_text="",
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[rng.uniform(-4, -0.5) for _ in completion],
                reward=0.0,
                advantage=rng.uniform(-1, 1),
                version_started=0,
                version_finished=0,
                finish_reason="stop",
                error=None,
                generate_s=0.0,
                reward_s=0.0,
                info="{}",
            )
        )
        if masked and i % 2 == 1 and len(completion) >= 3:
            mask = [1] * len(completion)
            cut = range(1, len(completion) - 1) if i == 1 else range(1, len(completion) // 2 + 1)
            for j in cut:
                mask[j] = 0
                rows[-1]["completion_logprobs"][j] = 0.0
            rows[-1]["completion_mask"] = mask
    return rows


def write_batch(storage: RunStorage, step: int, rows: list[dict]) -> None:
    storage.write_step_table("batches", step, rows_to_table(rows))


def sequences(rows: list[dict]) -> list[Sequence]:
    return [
        Sequence(
            r["prompt_ids"],
            r["completion_ids"],
            r["completion_logprobs"],
            r["advantage"],
            r["env"],
            (r["group_index"], r["sample_index"]),
        )
        for r in rows
    ]


def load(model_dir: str | Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )


def token_logprobs(model: torch.nn.Module, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of the row's completion tokens, the sequence alone, full logits."""
    p = len(row["prompt_ids"])
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    logp_T_V = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    logp_T = logp_T_V[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)[p - 1 :]
    entropy_T = -(logp_T_V.exp() * logp_T_V).sum(-1)[p - 1 : -1]
    return logp_T, entropy_T


def reference(
    model_dir: str | Path,
    rows: list[dict],
    cfg: LossConfig | None = None,
    old: dict | None = None,
    ref_dir: str | Path | None = None,
) -> dict:
    """Loss, gradients (HF names) and per-row log-probs of one process on the whole batch."""
    cfg = cfg or LossConfig()
    model = load(model_dir)
    ref_model = load(ref_dir) if ref_dir is not None else None
    masks = [r.get("completion_mask") or [1] * len(r["completion_ids"]) for r in rows]
    total = sum(sum(m) for m in masks)
    loss, logprobs = 0.0, []
    for r, mask in zip(rows, masks, strict=True):
        logp, entropy = token_logprobs(model, r)
        inference = torch.tensor([r["completion_logprobs"]], dtype=torch.float32)
        old_t = torch.tensor([old[(r["group_index"], r["sample_index"])]]) if old else inference
        ref = None
        if ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(ref_model, r)[0][None]
        inputs = LossInputs(
            logp[None],
            old_t,
            torch.tensor([r["advantage"]], dtype=torch.float32),
            torch.tensor([mask], dtype=torch.float32),
            inference_logprobs_B_T=inference,
            ref_logprobs_B_T=ref,
            entropy_B_T=entropy[None] if cfg.entropy_coef > 0 else entropy[None].detach(),
        )
        out = compute_loss(inputs, cfg)
        (out.loss_sum / total).backward()
        loss += float(out.loss_sum.detach()) / total
        logprobs.append(logp.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads, "logprobs": logprobs, "model": model}


def adamw_step(
    model: torch.nn.Module, lr: float, max_grad_norm: float, weight_decay: float = 0.0
) -> float:
    """The update the trainer's first optimizer step should make: clip, then AdamW."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay).step()
    return float(norm)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_abs(a: dict[str, torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in a.values())


def forward_backward_reply(**fields) -> ForwardBackwardReply:
    """A ``/forward_backward`` reply with plain figures (``fields`` override them), for the
    orchestrator's side of a test that fakes the trainer."""
    figures = dict.fromkeys(ForwardBackwardReply.model_fields, 0.0)
    figures.update(num_loss_tokens=1, num_tokens=1, per_env={}, ess=1.0, tis_weight=1.0)
    return ForwardBackwardReply(**{**figures, **fields})


def optim_step_reply(**fields) -> OptimStepReply:
    """An ``/optim_step`` reply (``fields`` override its figures)."""
    return OptimStepReply(
        **{"grad_norm": 1.0, "lr": 1e-3, "optim_step": 1, "optim_step_s": 0.0, **fields}
    )
