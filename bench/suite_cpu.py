"""Where a command's CPU goes, by kind of process: the suite's (or any command's) whole tree.

    .venv/bin/python bench/suite_cpu.py [--interval 0.5] [--json OUT] -- COMMAND ...
    .venv/bin/python bench/suite_cpu.py -- env CI=true bash .ci/run

Runs COMMAND and samples every process of the host every ``--interval`` seconds (``/proc``: its
command line when first seen, its name and CPU seconds at each look), then prints the CPU seconds
of the processes that started while it ran, summed by kind (vLLM's API server and engine core,
trainer ranks and their launchers, Prefect's servers and flow-run processes, ``rollflow run``,
the test workers, ...), with their count and mean: where a suite run's cores went, and so what
a cut would save. Every process of the host that started while COMMAND ran is counted, so run
nothing else beside it. A process that lives less than one interval may be missed; processes
that were running before COMMAND started are left out (their CPU is not the command's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import Machine  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = [  # (kind, a piece of its name or command line), first match wins
    ("vllm engine core", "VLLM::EngineCor"),
    ("vllm api server", "vllm.entrypoints"),
    ("vllm model inspection", "vllm.model_executor.models.registry"),
    ("trainer launcher: torchrun", "torch.distributed.run"),
    ("trainer launcher: deepspeed", "deepspeed.launcher"),
    ("trainer rank", "rollflow.trainer.rank_main"),
    ("prefect server", "rollflow.infra.prefect_server"),
    ("prefect server", "prefect server start"),
    ("prefect worker", "prefect worker start"),
    ("prefect flow-run process", "prefect.engine"),
    ("rollflow run", "rollflow.cli run"),
    ("rollflow, other commands", "rollflow.cli"),
    ("test worker (in-process work)", "exec(eval(sys.stdin.readline()))"),
    ("pytest", "pytest"),
    ("chromium", "chrom"),
    ("c++ compiler (torch inductor, DeepSpeed ops)", "cc1plus"),
    ("s3 server (moto)", "moto"),
]


def kind_of(name: str, cmdline: str) -> str:
    line = f"{name} {cmdline}"
    for kind, piece in KINDS:
        if piece in line:
            return kind
    if "python" in cmdline:
        return "python, other"
    return f"other: {name}"


def look(seen: dict, before: dict) -> None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            key = (entry.name, fields[19])  # pid and start time: a reused pid is another process
            if key in before:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if key not in seen:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                seen[key] = {"cmdline": cmdline, "name": name, "cpu_s": cpu}
            else:
                seen[key].update(name=name, cpu_s=cpu)  # vLLM renames its engine core
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--json", help="also write every process seen (command line, CPU) here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    machine = Machine()
    before: dict = {}
    look(before, {})
    seen: dict = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            look(seen, before)
            done.wait(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    code = subprocess.call(command)
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for proc in seen.values():
        kind = kind_of(proc["name"], proc["cmdline"])
        total[kind] += proc["cpu_s"]
        count[kind] += 1
    cpu = sum(total.values())
    print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s wall, {cpu:.0f} s of CPU")
    print(f"({cpu / wall:.2f} of {os.cpu_count()} cores) in {len(seen)} processes seen")
    print(f"{'CPU s':>8} {'share':>6} {'procs':>6} {'mean s':>7}  kind")
    for kind, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        n = count[kind]
        print(f"{seconds:8.1f} {seconds / cpu:6.1%} {n:6d} {seconds / n:7.1f}  {kind}")
    print(machine.line())
    if args.json:
        rows = [{"pid": int(pid), **proc} for (pid, _), proc in seen.items()]
        Path(args.json).write_text(json.dumps(rows))
    sys.exit(code)


if __name__ == "__main__":
    main()
