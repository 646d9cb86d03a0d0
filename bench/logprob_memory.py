"""Peak memory and time of forward+backward: naive full-logits log-probs/entropy against chunked.

    .venv/bin/python bench/logprob_memory.py [--shapes 4096x512x32000,...] [--chunk-sizes 1024,256]

Each (shape, variant) runs in a fresh subprocess on CPU with one torch thread. How memory is
measured, and why that is honest here:

- torch's CPU allocator is malloc, so tracemalloc sees nothing and torch.cuda stats do not apply.
  The child builds its inputs, then resets the kernel's resident-set high-water mark (writing "5"
  to /proc/self/clear_refs), reads VmRSS as the baseline, runs forward+backward once and reads
  VmHWM. peak = VmHWM - baseline: every page the step touched at its worst moment, including the
  gradients of hidden (N x H) and of the LM head (V x H) that both variants produce.
- A fresh process per variant keeps one variant's freed-but-cached memory out of another's figure.
- The child runs with MALLOC_MMAP_THRESHOLD_=1 MiB: glibc then serves every block of 1 MiB or
  more with mmap and unmaps it on free, so RSS follows the live tensors. With glibc's default
  (a threshold that grows up to 32 MiB) freed chunk buffers of ~31 MiB stayed in the heap and the
  same chunked run measured anywhere from 165 to 439 MiB; that is allocator policy, not the
  algorithm's need, and it only ever inflated the chunked figure.

Loss: sum(logprobs) + 0.01 * sum(entropy), so both gradient paths run.
Time: the best of --repeats forward+backward steps (the first is the measured one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 2**20


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(num_tokens: int, hidden: int, vocab: int, chunk_size: int, repeats: int) -> dict:
    """Runs in the subprocess: one variant, one shape. chunk_size 0 means the naive reference."""
    import gc

    import torch

    from rollflow.gpu_kernels.logprobs import (
        reference_logprobs_entropy,
        selective_logprobs_entropy,
    )

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden_N_H = torch.randn(num_tokens, hidden, generator=gen).requires_grad_()
    lm_head_V_H = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    targets_N = torch.randint(0, vocab, (num_tokens,), generator=gen)

    def step(hidden_N_H, lm_head_V_H, targets_N) -> float:
        hidden_N_H.grad = lm_head_V_H.grad = None
        start = time.perf_counter()
        if chunk_size:
            logprobs_N, entropy_N = selective_logprobs_entropy(
                hidden_N_H, lm_head_V_H, targets_N, chunk_size=chunk_size
            )
        else:
            logprobs_N, entropy_N = reference_logprobs_entropy(hidden_N_H, lm_head_V_H, targets_N)
        (logprobs_N.sum() + 0.01 * entropy_N.sum()).backward()
        return time.perf_counter() - start

    # A tiny step first pages in the kernels' code and starts autograd's worker: fixed costs that
    # would otherwise land in the first measured step of every variant.
    step(
        hidden_N_H[:4].detach().requires_grad_(),
        lm_head_V_H[:64].detach().requires_grad_(),
        targets_N[:4] % 64,
    )
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current VmRSS
    baseline_kib = _read_status_kib("VmRSS")
    times_s = [step(hidden_N_H, lm_head_V_H, targets_N)]
    peak_kib = _read_status_kib("VmHWM")
    times_s += [step(hidden_N_H, lm_head_V_H, targets_N) for _ in range(repeats - 1)]
    return {"peak_bytes": (peak_kib - baseline_kib) * 1024, "step_s": min(times_s)}


def _run_variant(shape: tuple[int, int, int], chunk_size: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([*shape, chunk_size, repeats])]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": str(MIB),
    }
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x512x32000,4096x512x128256", help="NxHxV,...")
    parser.add_argument("--chunk-sizes", default="1024,256")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*json.loads(args.child))))
        return

    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    header = (
        f"{'N':>5} {'H':>5} {'V':>7} {'variant':>14} {'peak MiB':>9} {'vs naive':>9}"
        f" {'step s':>7} {'vs naive':>9}"
    )
    print(header)
    print("-" * len(header))
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        num_tokens, hidden, vocab = shape
        logits_bytes = num_tokens * vocab * 4
        # The naive step peaks at about five N x V fp32 tensors (measured); keep a margin.
        if 6 * logits_bytes > _available_bytes():
            need_mib = 6 * logits_bytes / MIB
            print(
                f"{num_tokens:>5} {hidden:>5} {vocab:>7}  skipped: naive needs ~{need_mib:.0f} MiB"
            )
            continue
        naive = _run_variant(shape, 0, args.repeats)
        rows = [("naive", naive)] + [
            (f"chunked {c}", _run_variant(shape, c, args.repeats)) for c in chunk_sizes
        ]
        for name, result in rows:
            prefix = f"{num_tokens:>5} {hidden:>5} {vocab:>7} {name:>14}"
            if "error" in result or "error" in naive:
                print(f"{prefix}  failed: {result.get('error') or naive.get('error')}")
                continue
            print(
                f"{prefix} {result['peak_bytes'] / MIB:>9.0f}"
                f" {result['peak_bytes'] / naive['peak_bytes']:>9.3f}"
                f" {result['step_s']:>7.2f} {result['step_s'] / naive['step_s']:>9.2f}"
            )
        print(
            f"{'':>20} one fp32 N x V logits tensor = {logits_bytes / MIB:.0f} MiB;"
            f" grads of hidden + LM head = {(num_tokens + vocab) * hidden * 4 / MIB:.0f} MiB"
        )


if __name__ == "__main__":
    main()
