"""A one-rank trainer's start on CPU: the rank started alone (rollflow's default for one FSDP2
rank) against the same rank under torchrun.

    .venv/bin/python bench/trainer_start.py              # 3 starts of each, alternating
    .venv/bin/python bench/trainer_start.py --starts 5

Each start is rollflow's own ``TrainerProcess`` (one FSDP2 rank, the tiny char Llama), measured
from its start to rank 0 answering ``/health``; then every process of the trainer is read for
its CPU seconds (the launcher, where there is one, and the rank), and the trainer is stopped.
"torchrun" forces the launcher (``trainer_process.launches_directly`` answering no). The two
alternate, so that the machine's load falls on both alike; medians are printed with the ratio
alone / torchrun.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

ALONE = trainer_process.launches_directly


def one_start(model: Path, mode: str, root: Path, i: int) -> dict[str, float]:
    trainer_process.launches_directly = ALONE if mode == "alone" else (lambda *a: False)
    args = ServiceArgs(
        model_path=str(model),
        storage_root=str(root / "runs"),
        run=f"{mode}-{i}",
        trainer=TrainerServiceSection(device="cpu"),
    )
    proc = trainer_process.TrainerProcess(args, token="t", log_dir=root / f"{mode}-{i}")
    assert proc.direct == (mode == "alone")
    start = time.monotonic()
    proc.start()
    proc.wait_healthy()
    ready_s = time.monotonic() - start
    cpu = {"launcher": 0.0, "rank": 0.0}
    for pid in proc.process.pids()[1:]:  # not the guard
        p = psutil.Process(pid)
        times = p.cpu_times()
        kind = "launcher" if "torch.distributed.run" in p.cmdline() else "rank"
        cpu[kind] += times.user + times.system
    proc.stop()
    return {"ready_s": ready_s, "launcher_cpu_s": cpu["launcher"], "rank_cpu_s": cpu["rank"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each mode")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollflow-trainer-start-"))
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64)
    model = save_hf_dir(build_tiny_llama(spec, vocab_size=len(tok)), tok, root / "model")
    results: dict[str, list[dict[str, float]]] = {"alone": [], "torchrun": []}
    load = []
    for i in range(args.starts):
        for mode in ("alone", "torchrun"):
            load.append(os.getloadavg()[0])
            r = one_start(model, mode, root, i)
            results[mode].append(r)
            print(
                f"{mode:8s} #{i + 1}: healthy {r['ready_s']:.1f} s, CPU launcher "
                f"{r['launcher_cpu_s']:.1f} s + rank {r['rank_cpu_s']:.1f} s",
                flush=True,
            )
    print(f"\nmachine: {os.cpu_count()} cores, load {min(load):.1f}-{max(load):.1f}")
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for mode, rs in results.items()
    }
    for mode, m in med.items():
        total = m["launcher_cpu_s"] + m["rank_cpu_s"]
        print(f"{mode:8s} median: healthy {m['ready_s']:.1f} s, CPU {total:.1f} s")
    a, t = med["alone"], med["torchrun"]
    cpu_ratio = (a["launcher_cpu_s"] + a["rank_cpu_s"]) / (t["launcher_cpu_s"] + t["rank_cpu_s"])
    print(f"alone / torchrun: healthy {a['ready_s'] / t['ready_s']:.2f}x, CPU {cpu_ratio:.2f}x")


if __name__ == "__main__":
    main()
