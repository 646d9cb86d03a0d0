"""Resident memory of the run-flow process over hundreds of tiny steps (goal: ≤ 0.5 MB per step).

    .venv/bin/python bench/memory.py                          # 200 steps after 50 of warm-up, ~10 min
    .venv/bin/python bench/memory.py --steps 100 --warmup 30 --tracemalloc   # + where it grows

A real run (``rollflow run configs/quickstart.toml`` in a subprocess: vLLM, trainer service,
Prefect flows, TensorBoard sink) of a tiny config: the quickstart model, 8 groups of 4 per step,
evaluation only at the start and the end. The bench follows the run's ``events.jsonl`` and reads
the RSS of the run process (psutil) at every ``step_committed``; the services (vLLM, trainer,
Prefect server) are separate processes, reported beside it.

Figures: the slope of a least-squares line through (step, RSS) after the warm-up, in MB per step;
the same slope over the first and the second half of the measured steps (a leak grows steadily,
a warm-up flattens); the growth over the measured steps as a share of the RSS at the end of the
warm-up (the baseline, measured in the same run).

``--tracemalloc`` runs the CLI inside a wrapper that traces Python allocations (25 frames) and
writes the 15 call sites that grew most between the end of the warm-up and the last step. It
slows the run down; use it to find a cause, not for the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from rollflow.infra.events import Event  # noqa: E402
from rollflow.trainer.protocol import RANK_MAIN_MODULE  # noqa: E402

from machine import Machine, table  # noqa: E402

MB = 1e6
TINY = [
    "train.train_batch_size=8",
    "train.mini_batch_size=8",
    "sampling.group_size=4",
    "run.eval_every=0",
]


def traced_run(out: str, warmup_step: int, cli_args: list[str]) -> int:
    """The CLI, in this process, with tracemalloc; writes the top growth after ``warmup_step``."""
    import tracemalloc

    tracemalloc.start(25)
    events = Path(_storage_arg(cli_args)) / _name_arg(cli_args) / "events.jsonl"
    first: list = []

    def watch() -> None:
        while not first:
            if events.exists() and any(
                json.loads(line).get("step") == warmup_step
                for line in events.read_text().splitlines()
                if f'"{Event.STEP_COMMITTED}"' in line
            ):
                first.append(tracemalloc.take_snapshot())
                return
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    from rollflow.cli import main

    code = main(cli_args)
    last = tracemalloc.take_snapshot()
    if first:
        filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
        stats = last.filter_traces(filters).compare_to(first[0].filter_traces(filters), "traceback")
        lines = []
        for stat in stats[:15]:
            lines.append(f"{stat.size_diff / MB:+.3f} MB in {stat.count_diff:+d} blocks")
            lines += ["    " + line for line in stat.traceback.format(limit=8)]
        Path(out).write_text("\n".join(lines))
    return code


def _storage_arg(cli_args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cli_args if a.startswith("run.storage="))


def _name_arg(cli_args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cli_args if a.startswith("run.name="))


def follow(proc: subprocess.Popen, events: Path, deadline_s: float) -> list[dict]:
    """RSS of the run process and of its service processes at every committed step."""
    run = psutil.Process(proc.pid)
    samples, seen = [], 0
    start = time.monotonic()
    while proc.poll() is None:
        if time.monotonic() - start > deadline_s:
            proc.kill()
            sys.exit(f"the run did not finish within {deadline_s:.0f} s")
        lines = events.read_text().splitlines() if events.exists() else []
        for line in lines[seen:]:
            event = json.loads(line)
            if event["event"] == Event.STEP_COMMITTED:
                try:
                    samples.append(
                        {
                            "step": event["step"],
                            "time": event["time"],
                            "rss": run.memory_info().rss,
                            **services_rss(run),
                        }
                    )
                except psutil.NoSuchProcess:
                    pass
        seen = len(lines)
        time.sleep(0.1)
    return samples


SERVICES = {
    "trainer": RANK_MAIN_MODULE,
    "vLLM": "vllm",
    "Prefect server": "prefect.server",
}


def services_rss(run: psutil.Process) -> dict[str, int]:
    """RSS summed over the run's descendant processes, by service."""
    out = dict.fromkeys(SERVICES, 0)
    for child in run.children(recursive=True):
        try:
            cmdline, rss = " ".join(child.cmdline()), child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        # vLLM's engine core is spawned by multiprocessing: count what is not named as vLLM's.
        name = next((n for n, key in SERVICES.items() if key in cmdline), "vLLM")
        out[name] += rss
    return out


def slope(steps: np.ndarray, values: np.ndarray) -> float:
    return float(np.polyfit(steps, values, 1)[0]) if len(steps) >= 2 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument(
        "--traced-run", nargs=2, metavar=("OUT", "WARMUP_STEP"), help=argparse.SUPPRESS
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = parser.parse_args()
    if args.traced_run:
        sys.exit(traced_run(args.traced_run[0], int(args.traced_run[1]), args.overrides))

    machine = Machine()
    num_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-mem-") as tmp:
        cli_args = [
            "run",
            "configs/quickstart.toml",
            "run.name=mem",
            f"run.storage={tmp}",
            f"run.num_steps={num_steps}",
            *TINY,
            *args.overrides,
        ]
        trace_out = Path(tmp) / "tracemalloc.txt"
        cmd = (
            [
                sys.executable,
                __file__,
                "--traced-run",
                str(trace_out),
                str(args.warmup),
                "--",
                *cli_args,
            ]
            if args.tracemalloc
            else [sys.executable, "-m", "rollflow.cli", *cli_args]
        )
        log = open(Path(tmp) / "run.log", "w")
        env = {
            **os.environ,
            "PREFECT_HOME": str(Path(tmp) / "prefect"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        samples = follow(proc, Path(tmp) / "mem" / "events.jsonl", deadline_s=60 * 60)
        wall_s = time.monotonic() - start
        if proc.returncode:
            sys.exit(
                f"the run failed ({proc.returncode}):\n"
                + (Path(tmp) / "run.log").read_text()[-4000:]
            )
        trace = trace_out.read_text() if trace_out.exists() else ""

    steps = np.array([s["step"] for s in samples])
    rss_mb = np.array([s["rss"] for s in samples]) / MB
    measured = steps > args.warmup
    m_steps, m_rss = steps[measured], rss_mb[measured]
    half = len(m_steps) // 2
    base_mb = rss_mb[~measured][-1] if (~measured).any() else rss_mb[0]
    fit = slope(m_steps, m_rss)
    times = np.array([s["time"] for s in samples])
    step_s = (
        (times[-1] - times[~measured][-1]) / measured.sum() if (~measured).any() else float("nan")
    )
    rows = [
        [
            "run process RSS, slope over the measured steps",
            f"{fit:+.3f} MB/step",
            f"{fit / 0.5:.2f}× the goal (0.5 MB/step)",
        ],
        [
            "… first half / second half",
            f"{slope(m_steps[:half], m_rss[:half]):+.3f} / "
            f"{slope(m_steps[half:], m_rss[half:]):+.3f} MB/step",
            "",
        ],
        [
            "run process RSS at the end of the warm-up (baseline) → last step",
            f"{base_mb:.0f} → {m_rss[-1]:.0f} MB",
            f"{(m_rss[-1] - base_mb) / base_mb:+.1%} of the baseline",
        ],
        *[
            [
                f"{name} processes (not the run process), slope",
                f"{slope(m_steps, mb[measured]):+.3f} MB/step",
                f"{mb[measured][0]:.0f} → {mb[measured][-1]:.0f} MB",
            ]
            for name in SERVICES
            for mb in [np.array([s[name] for s in samples]) / MB]
        ],
        [
            "steps sampled (warm-up + measured)",
            f"{(~measured).sum()} + {measured.sum()}",
            f"run wall clock {wall_s:.0f} s; {step_s:.2f} s/step over the measured steps",
        ],
    ]
    print(
        f"\nrun-flow process memory, quickstart model, 8 groups × 4 per step, {num_steps} steps"
        + (" (under tracemalloc)" if args.tracemalloc else "")
    )
    print(machine.line() + "\n")
    print(table(["what", "figure", "vs baseline / goal"], rows))
    print(
        "\nRSS by step (MB): "
        + ", ".join(f"{s}: {r:.0f}" for s, r in zip(steps[::25], rss_mb[::25], strict=True))
    )
    if trace:
        print(f"\n### tracemalloc: largest growth between step {args.warmup} and the last step\n")
        print(trace)


if __name__ == "__main__":
    main()
