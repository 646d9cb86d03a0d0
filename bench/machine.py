"""What every benchmark prints beside its figures: the machine and how busy it was (and the tiny
model the vLLM benchmarks serve).

The benchmark machines are shared, so absolute timings are noisy; each bench prints ratios
against a baseline measured in the same run, and this line says how loaded the machine was
at the start and the end of the run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def _loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}/{five:.2f}/{fifteen:.2f}"


class Machine:
    """Records the load average when created; ``line()`` adds the load at the end."""

    def __init__(self) -> None:
        self.start_load = _loadavg()
        self.start = time.time()

    def line(self) -> str:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return (
            f"machine: {platform.machine()} {_cpu_model()}, {os.cpu_count()} CPUs, "
            f"{mem_gib:.0f} GiB; load average (1/5/15 min) at start {self.start_load}, "
            f"at end {_loadavg()}; {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.start))}, "
            f"{time.time() - self.start:.0f} s"
        )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def alternate(
    modes: tuple[str, ...], rounds: int, measure: Callable[[str, int], dict[str, float]], say
) -> dict[str, dict[str, float]]:
    """``measure(mode, round)`` for each mode in turn, ``rounds`` times, so that the machine's
    load falls on every mode alike; ``say(mode, round, figures)`` prints each. Returns each
    mode's median of every figure, after printing the load over the rounds."""
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    load = []
    for i in range(rounds):
        for mode in modes:
            load.append(os.getloadavg()[0])
            results[mode].append(measure(mode, i))
            say(mode, i, results[mode][-1])
    print(f"\nmachine: {os.cpu_count()} cores, load {min(load):.1f}-{max(load):.1f}")
    return {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for mode, rs in results.items()
    }


def tiny_char_llama(folder: Path) -> Path:
    """The tiny char Llama the vLLM benchmarks serve (random weights, its char tokenizer), saved
    as a Hugging Face folder under ``folder``; returns the folder."""
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64)
    return save_hf_dir(build_tiny_llama(spec, vocab_size=len(tok)), tok, folder / "model")
