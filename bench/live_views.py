"""What a redraw of the run's live views costs as a run grows (flows/live_views.py).

    .venv/bin/python bench/live_views.py [--steps 100 400] [--repeats 3]

For each size, writes a fake finished run of that many committed steps (``status_time.py``'s
quickstart-shaped metrics rows, a checkpoint marker and a commit event per step) to a temporary
folder, then times, per redraw, reading the committed metrics the way the views did before
2026-12-07 (``committed_metrics``: every step's file at every redraw, the baseline) and through
``CommittedMetrics`` (each file read once where it cannot change; the first read is the cold
one), and drawing the PNG. The share of a run that redraws take is paced separately
(``REDRAW_SHARE``): this prints the cost that pacing divides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, status_time.py

from status_time import fake_quickstart  # noqa: E402

from rollflow.flows.live_views import REDRAW_SHARE, curves_png, snapshot  # noqa: E402
from rollflow.infra.storage import RunStorage  # noqa: E402
from rollflow.runs import CommittedMetrics, committed_metrics  # noqa: E402

from machine import Machine, table  # noqa: E402


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    machine, rows = Machine(), []
    for num_steps in args.steps:
        with tempfile.TemporaryDirectory() as root:
            fake_quickstart(root, num_steps)
            storage = RunStorage(root, "quickstart")
            kept = CommittedMetrics(storage)
            cold = seconds(kept.read)
            every = [seconds(committed_metrics, storage) for _ in range(args.repeats)]
            again = [seconds(kept.read) for _ in range(args.repeats)]
            snap = snapshot(storage, kept)
            draw = [seconds(curves_png, snap) for _ in range(args.repeats)]
        read_all, read_kept = statistics.median(every), statistics.median(again)
        rows.append(
            [
                num_steps,
                f"{read_all:.3f}",
                f"{cold:.3f}",
                f"{read_kept:.4f}",
                f"{read_kept / read_all:.3f}x",
                f"{statistics.median(draw):.3f}",
            ]
        )
    print(machine.line())
    print(f"medians of {args.repeats}; redraws are paced to {REDRAW_SHARE:.0%} of the run's time")
    print(
        table(
            [
                "committed steps",
                "read every file (before), s",
                "CommittedMetrics first read, s",
                "CommittedMetrics again, s",
                "again / before",
                "draw the PNG, s",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
