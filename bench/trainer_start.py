"""A trainer's start on CPU without the launcher process rollflow no longer runs, against with it:
one FSDP2 rank started alone (rollflow's default) against the same rank under torchrun, or
DeepSpeed's per-node launcher started directly (rollflow, on one node as on several) against the
``deepspeed`` command's runner, which starts that launcher and waits.

    .venv/bin/python bench/trainer_start.py                        # FSDP2, 3 starts of each
    .venv/bin/python bench/trainer_start.py --backend deepspeed --starts 2

Each start is rollflow's own ``TrainerProcess`` (the tiny char Llama; FSDP2: one rank, DeepSpeed
ZeRO-1: two), measured from its start to rank 0 answering ``/health``; then every process of
the trainer is read for its CPU seconds (launchers and ranks), and the trainer is stopped. The
baseline's command is made here: torchrun by ``trainer_process.launches_directly`` answering
no; the runner as ``deepspeed --num_gpus N --module ...`` (its module form) would run it. The two
alternate, so that the machine's load falls on both alike; medians are printed with the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.infra.config import TinyModelSpec, TrainerServiceSection  # noqa: E402
from rollflow.infra.models.tiny import (  # noqa: E402
    build_char_tokenizer,
    build_tiny_llama,
    save_hf_dir,
)
from rollflow.services import trainer_process  # noqa: E402
from rollflow.trainer.protocol import ServiceArgs  # noqa: E402

from machine import alternate  # noqa: E402 (this folder's)

ALONE = trainer_process.launches_directly
LAUNCHERS = ("torch.distributed.run", "deepspeed.launcher.runner", "deepspeed.launcher.launch")
MODES = {"fsdp2": ("alone", "torchrun"), "deepspeed": ("launch", "runner")}


def one_start(model: Path, backend: str, mode: str, root: Path, i: int) -> dict[str, float]:
    trainer_process.launches_directly = ALONE if mode != "torchrun" else (lambda *a: False)
    ranks = 1 if backend == "fsdp2" else 2
    trainer = TrainerServiceSection(
        device="cpu", backend=backend, num_ranks=ranks, startup_timeout_s=600
    )
    args = ServiceArgs(
        model_path=str(model), storage_root=str(root / "runs"), run=f"{mode}-{i}", trainer=trainer
    )
    proc = trainer_process.TrainerProcess(args, token="t", log_dir=root / f"{mode}-{i}")
    if mode == "runner":  # the deepspeed command (module form) in place of its launcher
        head = proc.process.argv.index("--master_addr=127.0.0.1")
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={ranks}"]
        proc.process.argv = runner + proc.process.argv[head:]
    start = time.monotonic()
    proc.start()
    proc.wait_healthy()
    ready_s = time.monotonic() - start
    cpu = {"launcher": 0.0, "rank": 0.0}
    for pid in proc.process.pids()[1:]:  # not the guard
        p = psutil.Process(pid)
        times = p.cpu_times()
        kind = "launcher" if any(m in p.cmdline() for m in LAUNCHERS) else "rank"
        cpu[kind] += times.user + times.system
    proc.stop()
    return {"ready_s": ready_s, "launcher_cpu_s": cpu["launcher"], "rank_cpu_s": cpu["rank"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each mode")
    parser.add_argument("--backend", choices=list(MODES), default="fsdp2")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollflow-trainer-start-"))
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64)
    model = save_hf_dir(build_tiny_llama(spec, vocab_size=len(tok)), tok, root / "model")
    ours, base = MODES[args.backend]

    def say(mode: str, i: int, r: dict[str, float]) -> None:
        print(
            f"{mode:8s} #{i + 1}: healthy {r['ready_s']:.1f} s, CPU launcher "
            f"{r['launcher_cpu_s']:.1f} s + rank {r['rank_cpu_s']:.1f} s",
            flush=True,
        )

    med = alternate(
        (ours, base),
        args.starts,
        lambda mode, i: one_start(model, args.backend, mode, root, i),
        say,
    )
    for mode, m in med.items():
        total = m["launcher_cpu_s"] + m["rank_cpu_s"]
        print(f"{mode:8s} median: healthy {m['ready_s']:.1f} s, CPU {total:.1f} s")
    a, t = med[ours], med[base]
    cpu_ratio = (a["launcher_cpu_s"] + a["rank_cpu_s"]) / (t["launcher_cpu_s"] + t["rank_cpu_s"])
    print(f"{ours} / {base}: healthy {a['ready_s'] / t['ready_s']:.2f}x, CPU {cpu_ratio:.2f}x")


if __name__ == "__main__":
    main()
