"""Trainer throughput: tokens/s of forward_backward + optim_step, service vs a bare torch loop.

For each backend configuration, the real trainer service is started (torchrun or the deepspeed
launcher, gloo on CPU), fed quickstart-shaped batches through its HTTP API exactly as the train
task does, and timed from the client (HTTP, Parquet, dispatch and packing included). The same
batches go through a bare torch loop in this process, alternating with the service mini-batch by
mini-batch (this machine is shared: both loops see the same load): an HF model, padded
micro-batches of the same token budget, full-vocabulary fp32 log-softmax, the same PPO loss,
clip, AdamW. The ratio is service / bare loop.

    .venv/bin/python bench/trainer_throughput.py [--configs fsdp2:1 deepspeed:2:3 ...]

Prints one table; the first two mini-batches of every measurement are warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollflow.infra.config import LossConfig, TinyModelSpec, TrainerServiceSection, TrainSection
from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir
from rollflow.infra.schema import rows_to_table
from rollflow.infra.storage import RunStorage
from rollflow.services.trainer_process import TrainerProcess
from rollflow.trainer.losses import LossInputs, compute_loss
from rollflow.trainer.protocol import ServiceArgs

WARMUP = 2
LOSS = LossConfig(eps_low=0.2, eps_high=0.2)


def quickstart_rows(step: int, num_groups: int, group_size: int, rng: random.Random) -> list[dict]:
    """Rows shaped like the quickstart's (prompt ~10 tokens, completion 2-8 tokens)."""
    rows = []
    for g in range(num_groups):
        prompt = [1] + [rng.randint(4, 40) for _ in range(rng.randint(8, 12))]
        for s in range(group_size):
            completion = [rng.randint(4, 40) for _ in range(rng.randint(1, 7))] + [2]
            rows.append(
                dict(
                    run="bench",
                    step=step,
                    env="sort_letters",
                    prompt_id=str(g),
                    group_index=g,
                    sample_index=s,
                    prompt_text="",
                    completion_text="",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    completion_logprobs=[rng.uniform(-3.0, -0.1) for _ in completion],
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
    return rows


def num_tokens(rows: list[dict]) -> int:
    return sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)


# ------------------------------------------------------------------------------ bare torch


class BareTorch:
    """A plain loop: padded micro-batches, full-vocabulary fp32 logits, the PPO loss, clip, AdamW."""

    def __init__(self, model_dir: Path, micro_batch_tokens: int, lr: float):
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.micro_batch_tokens = micro_batch_tokens
        self.cfg = LOSS

    def step(self, rows: list[dict]) -> None:
        total = sum(len(r["completion_ids"]) for r in rows)
        for micro in _padded_micro_batches(rows, self.micro_batch_tokens):
            ids, attn, old, mask, adv = _collate(micro)
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            logp = torch.nn.functional.pad(logp, (1, 0))
            out = compute_loss(
                LossInputs(logp, old, adv, mask, inference_logprobs_B_T=old), self.cfg
            )
            (out.loss_sum / total).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _padded_micro_batches(rows, budget):
    batch, longest = [], 0
    for row in rows:
        length = len(row["prompt_ids"]) + len(row["completion_ids"])
        if batch and max(longest, length) * (len(batch) + 1) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(row)
        longest = max(longest, length)
    if batch:
        yield batch


def _collate(rows):
    T = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    ids, attn = (
        torch.zeros(len(rows), T, dtype=torch.long),
        torch.zeros(len(rows), T, dtype=torch.long),
    )
    old, mask = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        ids[i, : p + c] = torch.tensor(r["prompt_ids"] + r["completion_ids"])
        attn[i, : p + c] = 1
        old[i, p : p + c] = torch.tensor(r["completion_logprobs"])
        mask[i, p : p + c] = 1
    return ids, attn, old, mask, torch.tensor([r["advantage"] for r in rows])


# ------------------------------------------------------------------------------ the service


def measure(
    model_dir: Path,
    root: Path,
    batches: list[list[dict]],
    backend: str,
    num_ranks: int,
    zero_stage: int,
    micro_batch_tokens: int,
    lr: float,
) -> tuple[float, float, float]:
    """(service tok/s, bare tok/s, service start-up s), the two loops alternating mini-batch by
    mini-batch so that both see the same machine (the service idles while the bare loop runs)."""
    trainer = TrainerServiceSection(
        backend=backend,
        num_ranks=num_ranks,
        zero_stage=zero_stage if backend == "deepspeed" else None,
        micro_batch_tokens=micro_batch_tokens,
        device="cpu",
        startup_timeout_s=900,
    )
    args = ServiceArgs(
        model_path=str(model_dir),
        storage_root=str(root / "runs"),
        run="bench",
        train=TrainSection(lr=lr, max_grad_norm=1.0),
        trainer=trainer,
    )
    proc = TrainerProcess(
        args, token=secrets.token_hex(8), log_dir=root / f"logs-{backend}-{num_ranks}-{zero_stage}"
    )
    bare = BareTorch(model_dir, micro_batch_tokens, lr)
    start = time.perf_counter()
    proc.start()
    try:
        proc.wait_healthy()
        startup_s = time.perf_counter() - start
        served_s = bare_s = 0.0
        counted_tokens = 0
        for step, rows in enumerate(batches, start=1):
            t0 = time.perf_counter()
            bare.step(rows)
            t1 = time.perf_counter()
            proc.client.forward_backward(step, loss=LOSS)
            proc.client.optim_step()
            t2 = time.perf_counter()
            if step > WARMUP:
                bare_s += t1 - t0
                served_s += t2 - t1
                counted_tokens += num_tokens(rows)
        return counted_tokens / served_s, counted_tokens / bare_s, startup_s
    finally:
        proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["fsdp2:1", "fsdp2:2", "deepspeed:2:1", "deepspeed:2:2", "deepspeed:2:3"],
        help="backend:ranks[:zero_stage]",
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="mini-batches per measurement (2 are warm-up)"
    )
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the bare loop and of each rank (0: all cores / ranks)",
    )
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
        os.environ["ROLLFLOW_TRAINER_THREADS"] = str(ns.threads)  # read by the launcher, per rank
    threads = torch.get_num_threads()
    root = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    tok = build_char_tokenizer()
    spec = TinyModelSpec(
        hidden_size=ns.hidden, num_heads=ns.hidden // 32, intermediate_size=2 * ns.hidden
    )
    model_dir = save_hf_dir(build_tiny_llama(spec, vocab_size=len(tok)), tok, root / "model")
    rng = random.Random(0)
    storage = RunStorage(str(root / "runs"), "bench")
    batches = [
        quickstart_rows(step, ns.groups, ns.group_size, rng) for step in range(1, ns.steps + 1)
    ]
    for step, rows in enumerate(batches, start=1):
        storage.write_step_table("batches", step, rows_to_table(rows))
    print(
        f"model: hidden {ns.hidden}, 2 layers; {ns.steps} mini-batches of {ns.groups}x{ns.group_size} rows, "
        f"~{num_tokens(batches[0])} tokens each; micro-batch budget {ns.micro_batch_tokens}; "
        f"bare torch on {threads} threads, ranks on {os.environ.get('ROLLFLOW_TRAINER_THREADS', 'cores / ranks')}"
    )
    print(
        f"{'backend':<12}{'ranks':>6}{'zero':>6}{'service tok/s':>15}{'bare tok/s':>12}{'ratio':>8}{'start s':>9}"
    )
    for config in ns.configs:
        backend, ranks, *stage = config.split(":")
        zero = int(stage[0]) if stage else 1
        served, bare, startup_s = measure(
            model_dir, root, batches, backend, int(ranks), zero, ns.micro_batch_tokens, 1e-4
        )
        print(
            f"{backend:<12}{ranks:>6}{(zero if backend == 'deepspeed' else '-'):>6}{served:>15.0f}{bare:>12.0f}"
            f"{served / bare:>8.2f}{startup_s:>9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
