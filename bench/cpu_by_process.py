"""CPU seconds per committed step of each of a running run's processes, over a window.

    .venv/bin/python bench/cpu_by_process.py METRICS_DIR [--window 30]

METRICS_DIR is the running run's ``<storage>/<run>/metrics`` folder (e.g. that of a
``bench/vs_trl.py ... --keep-runs DIR`` run: ``DIR/seed-0/vs-trl/metrics``). Samples every
process of this host that belongs to a run (the run process, vLLM's API server and engine core,
the trainer ranks and their launcher, the private Prefect API), sleeps ``--window`` seconds,
samples again, and divides each group's CPU time by the steps committed in between (metrics
files written). Processes of other runs on the host are counted too: run one at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import Machine  # noqa: E402

GROUPS = [  # (group, a piece of its command line), first match wins
    ("run", "rollflow.cli run"),
    ("vllm engine core", "EngineCore"),
    ("vllm api server", "vllm.entrypoints"),
    ("trainer rank", "rollflow.trainer.rank_main"),
    ("trainer launcher", "torch.distributed.run"),
    ("prefect api", "rollflow.infra.prefect_server"),
]


def group_of(proc: psutil.Process) -> str | None:
    try:
        line = " ".join(proc.cmdline()) + " " + proc.name()
    except psutil.Error:
        return None
    return next((group for group, piece in GROUPS if piece in line), None)


def cpu_s(procs: dict[psutil.Process, str]) -> dict[psutil.Process, float]:
    out = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            out[proc] = times.user + times.system
        except psutil.Error:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics_dir", type=Path)
    parser.add_argument("--window", type=float, default=30.0)
    args = parser.parse_args()
    machine = Machine()
    procs = {p: g for p in psutil.process_iter() if (g := group_of(p))}
    if not procs:
        sys.exit("no process of a run is running on this host")
    steps0, before, t0 = (
        len(list(args.metrics_dir.glob("step=*.parquet"))),
        cpu_s(procs),
        time.time(),
    )
    time.sleep(args.window)
    steps1, after, t1 = (
        len(list(args.metrics_dir.glob("step=*.parquet"))),
        cpu_s(procs),
        time.time(),
    )
    steps = steps1 - steps0
    if steps < 1:
        sys.exit(f"no step committed in {args.window:g} s: give a longer --window")
    by_group: dict[str, float] = {}
    for proc, start in before.items():
        if proc in after:
            by_group[procs[proc]] = by_group.get(procs[proc], 0.0) + after[proc] - start
    print(machine.line())
    print(f"{steps} steps in {t1 - t0:.1f} s: {(t1 - t0) / steps:.3f} s per step")
    print("| process | CPU s per step | cores |\n|---|---|---|")
    for group, used in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {used / steps:.3f} | {used / (t1 - t0):.2f} |")
    total = sum(by_group.values())
    print(f"| all | {total / steps:.3f} | {total / (t1 - t0):.2f} |")


if __name__ == "__main__":
    main()
