"""Soak: every process's RSS and the step time over a long run of tiny steps (not in CI).

    .venv/bin/python bench/soak.py                         # 1000 steps, vLLM under jemalloc if found
    .venv/bin/python bench/soak.py --steps 300 --compare   # glibc malloc, then jemalloc, same run shape
    ROLLFLOW_JEMALLOC=/path/libjemalloc.so.2 .venv/bin/python bench/soak.py ...

A real ``rollflow run`` of the quickstart model (8 groups of 4 per step, no evaluation but at the
start and the end), local storage. At every ``step_committed`` event the bench reads the RSS of
each process of the run: the run process, the private Prefect API, the trainer's rank(s), and
vLLM's API server, EngineCore and worker apart (the worker is where generation allocates).
Figures, over the steps after the warm-up (the first ``--warmup`` steps, default 30% of them;
vLLM's worker fills its per-shape caches for ~130 steps): the least-squares slope of each
process's RSS in MB per step (and over each half, since a warm-up flattens while a leak does
not), and the slope of the step time in ms per step. With ``--compare`` both allocators run
one after the other and the ratios of the worker's slope are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from memory import TINY, slope  # noqa: E402

from rollflow.infra.events import Event  # noqa: E402
from rollflow.trainer.protocol import RANK_MAIN_MODULE  # noqa: E402

MB = 1e6


def label(proc: psutil.Process, run_pid: int) -> str | None:
    """Which part of the run a process is (None: a bash guard or a launcher)."""
    if proc.pid == run_pid:
        return "run process"
    cmd = " ".join(proc.cmdline())
    name = proc.name()
    if cmd.startswith("bash") or "torch.distributed.run" in cmd:
        return None
    if "prefect" in cmd and "server" in cmd:
        return "Prefect API"
    if RANK_MAIN_MODULE in cmd:
        return f"trainer rank {proc.environ().get('RANK', '0')}"
    if "vllm.entrypoints" in cmd:
        return "vLLM API server"
    if "EngineCore" in name or "EngineCore" in cmd:
        return "vLLM EngineCore"
    if "Worker" in name or "Worker" in cmd:
        return "vLLM worker"
    if "multiprocessing" in cmd:  # vLLM's spawned children without a title: by their place
        children = proc.children()
        return "vLLM EngineCore" if children else "vLLM worker"
    return None


def sample(run: psutil.Process) -> dict[str, int]:
    out: dict[str, int] = {}
    for proc in [run, *run.children(recursive=True)]:
        try:
            name = label(proc, run.pid)
            if name is not None:
                out[name] = out.get(name, 0) + proc.memory_info().rss
        except psutil.Error:
            continue
    return out


def soak(steps: int, jemalloc: str, log_to: Path) -> list[dict]:
    """One run; returns a sample per committed step: step, time, RSS by process."""
    with tempfile.TemporaryDirectory(prefix="rollflow-soak-") as tmp:
        cli_args = [
            "run",
            "configs/quickstart.toml",
            "run.name=soak",
            f"run.storage={tmp}",
            f"run.num_steps={steps}",
            "metrics.sinks=[]",
            *TINY,
        ]
        env = {
            **os.environ,
            "PREFECT_HOME": str(Path(tmp) / "prefect"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "ROLLFLOW_JEMALLOC": jemalloc,
        }
        events = Path(tmp) / "soak" / "events.jsonl"
        with open(log_to, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollflow.cli", *cli_args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            run = psutil.Process(proc.pid)
            samples, seen = [], 0
            while proc.poll() is None:
                lines = events.read_text().splitlines() if events.exists() else []
                for line in lines[seen:]:
                    event = json.loads(line)
                    if event["event"] == Event.STEP_COMMITTED:
                        samples.append(
                            {"step": event["step"], "time": event["time"], **sample(run)}
                        )
                seen = len(lines)
                time.sleep(0.05)
        if proc.returncode:
            sys.exit(f"the run failed ({proc.returncode}); see {log_to}")
    return samples


def report(samples: list[dict], warmup: int, title: str) -> dict[str, float]:
    steps = np.array([s["step"] for s in samples])
    keep = steps > warmup
    m = steps[keep]
    half = len(m) // 2
    print(f"\n{title}: {len(samples)} steps sampled, slopes over steps {m[0]}..{m[-1]}")
    print(f"{'process':<18} {'RSS MB':>15} {'MB/step':>9} {'1st half':>9} {'2nd half':>9}")
    slopes = {}
    names = sorted({k for s in samples for k in s if k not in ("step", "time")})
    for name in names:
        mb = np.array([s.get(name, 0) for s in samples])[keep] / MB
        slopes[name] = slope(m, mb)
        print(
            f"{name:<18} {mb[0]:>7.0f} → {mb[-1]:>5.0f} {slopes[name]:>+9.4f} "
            f"{slope(m[:half], mb[:half]):>+9.4f} {slope(m[half:], mb[half:]):>+9.4f}"
        )
    times = np.array([s["time"] for s in samples])
    step_s = np.diff(times)[keep[1:]]
    step_ms_slope = slope(m[-len(step_s) :], step_s * 1e3)
    tenth = max(1, len(step_s) // 10)
    print(
        f"step time: median {np.median(step_s):.3f} s; first 10% {np.median(step_s[:tenth]):.3f} s,"
        f" last 10% {np.median(step_s[-tenth:]):.3f} s; slope {step_ms_slope:+.4f} ms/step"
    )
    slopes["step_ms"] = step_ms_slope
    return slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, help="steps left out of the slopes (default 30%%)")
    parser.add_argument("--compare", action="store_true", help="glibc malloc, then jemalloc")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else int(0.3 * args.steps)
    from rollflow.services.vllm_server import find_jemalloc

    lib = find_jemalloc(dict(os.environ))
    print(f"load average {os.getloadavg()[0]:.2f}; jemalloc: {lib or 'not found'}")
    default = os.environ.get("ROLLFLOW_JEMALLOC", "")
    runs = (
        [("glibc malloc", "0"), ("jemalloc", lib or "0")] if args.compare else [("as set", default)]
    )
    results = {}
    for title, jemalloc in runs:
        if title == "jemalloc" and not lib:
            print("jemalloc not found: set ROLLFLOW_JEMALLOC=/path/libjemalloc.so.2")
            break
        start = time.monotonic()
        log = Path(tempfile.gettempdir()) / f"soak-{title.split()[0]}.log"
        samples = soak(args.steps, jemalloc, log)
        results[title] = report(samples, warmup, f"{title} ({time.monotonic() - start:.0f} s)")
    if len(results) == 2:
        glibc, jem = results["glibc malloc"], results["jemalloc"]
        for name in ("vLLM worker", "vLLM EngineCore", "vLLM API server"):
            if name in glibc and name in jem:
                print(
                    f"{name}: {glibc[name]:+.4f} MB/step under glibc, {jem[name]:+.4f} under "
                    f"jemalloc"
                )
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
