"""The trainer's peak memory with and without activation checkpointing, on CPU.

    .venv/bin/python bench/activation_memory.py            # ~5 minutes on 2 cores

One optimizer step of the trainer (``rank_trainer.Trainer``, FSDP2 on one rank, fp32 on CPU)
of a random-init Llama (8 layers, width 512, 34M parameters) on 16 sequences of 1024 tokens
packed into 4k-token micro-batches, as the trainer service packs them, once with
``trainer.activation_checkpointing`` off and once on, each in a process of its own. Figures:
the process's peak resident memory (``ru_maxrss``) after the steps, less its peak before the
first step (the model, its gradients and the optimizer state are then in place), and the step
time. The same rows on a GPU are the device check's ``fsdp2 step`` and ``fsdp2 step, activation
checkpointing`` (``bench/device_check.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)
BATCH = dict(seqs=16, prompt=256, completion=768, micro_tokens=4096)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(model: Path, checkpointing: bool, steps: int) -> dict:
    """One process's figures (called in a child: its peak is its own)."""
    import device_check
    import torch

    from rollflow.infra.config import LossConfig, TrainerServiceSection, TrainSection
    from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = torch.device("cpu")
    device_check._init_dist(device)
    spec = TrainerSpec(
        model_path=str(model),
        train=TrainSection(lr=1e-6),
        trainer=TrainerServiceSection(activation_checkpointing=checkpointing),
        weight_dtype="float32",
    )
    trainer = Trainer(spec, device)
    micro_batches, _ = device_check._batch(False, SHAPE["vocab_size"], BATCH)
    before = _peak_mib()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        total = sum(len(mb.targets_N) for mb in micro_batches if not mb.is_empty)
        trainer.forward_backward(micro_batches, LossConfig(), float(total))
        trainer.optim_step()
        times.append(time.perf_counter() - start)
    after = _peak_mib()
    trainer.close()
    return {
        "activation_checkpointing": checkpointing,
        "peak_before_step_mib": round(before),
        "peak_mib": round(after),
        "step_peak_mib": round(after - before),
        "step_s": round(min(times), 2),
        "micro_batches": len(micro_batches),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row = measure(Path(args.child[0]), args.child[1] == "on", args.steps)
        print(json.dumps(row))
        return 0
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    work = Path(tempfile.mkdtemp(prefix="rollflow-ac-"))
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "model")
    rows = []
    for mode in ("off", "on"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--steps",
                str(args.steps),
                "--child",
                str(work / "model"),
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"model: {params / 1e6:.0f}M parameters, {BATCH['seqs']} x {BATCH['prompt'] + BATCH['completion']} tokens a step"
    )
    print(
        "| activation checkpointing | peak during the step beyond the loaded trainer (MiB) | process peak (MiB) | step (s) |"
    )
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {'on' if r['activation_checkpointing'] else 'off'} | {r['step_peak_mib']} | "
            f"{r['peak_mib']} | {r['step_s']} |"
        )
    off, on = rows
    print(
        f"saved: {off['step_peak_mib'] - on['step_peak_mib']} MiB of the step's peak "
        f"({1 - on['step_peak_mib'] / max(1, off['step_peak_mib']):.0%}), "
        f"step time x{on['step_s'] / off['step_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
