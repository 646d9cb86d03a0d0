"""Wall time of `rollflow status` on a finished quickstart-sized run (goal: under 3 s).

    .venv/bin/python bench/status_time.py [--steps 60] [--repeats 5]

Writes a fake run the size of a finished quickstart (one metrics Parquet per step with the
quickstart's columns, a committed checkpoint marker per step, the events file) to a temporary
folder, then times the real command in a fresh interpreter each time, as a user runs it, and
prints the best, median and worst wall time. The baseline measured in the same run is a bare
`python -c pass`, the interpreter start that every command pays.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from rollflow.infra.events import Event
from rollflow.infra.storage import RunStorage


def fake_quickstart(root: str, num_steps: int) -> None:
    storage = RunStorage(root, "quickstart")
    storage.write_metrics(0, {"eval_reward": 0.504, "eval_reward/sort_letters": 0.504})
    for step in range(1, num_steps + 1):
        row = {
            "reward_mean": 0.4,
            "reward/sort_letters": 0.4,
            "num_rollouts": 2048,
            "num_errors": 0,
            "rollouts_reused": False,
            "retries": 0,
            "num_groups_kept": 116,
            "num_samples_kept": 1856,
            "loss": 0.0175,
            "grad_norm": 0.5,
            "clip_fraction": 0.01,
            "mismatch_kl": 0.001,
            "neg_logprob_mean": 0.7,
            "num_optim_steps": 1,
            "num_loss_tokens": 9000,
            "train_s": 2.7,
            "sync_s": 0.17,
            "sync_pause_s": 0.01,
            "generate_phase_s": 2.37,
            "advantage_phase_s": 0.05,
            "train_phase_s": 2.75,
            "sync_phase_s": 0.17,
            "step_s": 5.43,
        }
        if step % 10 == 0:
            row.update({"eval_reward": 0.8, "eval_reward/sort_letters": 0.8})
        storage.write_metrics(step, row)
        storage.commit("checkpoints", step)
        storage.append_event(Event.STEP_COMMITTED, step=step)
    storage.append_event(Event.TRAINING_FINISHED, step=num_steps)


def wall_s(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        fake_quickstart(root, args.steps)
        status = [sys.executable, "-m", "rollflow.cli", "status", "quickstart", "--storage", root]
        bare = [sys.executable, "-c", "pass"]
        wall_s(status)  # warm the page cache, as a second look at a run would be
        times = sorted(wall_s(status) for _ in range(args.repeats))
        base = min(wall_s(bare) for _ in range(args.repeats))
    print(
        f"rollflow status on a {args.steps}-step run: best {times[0]:.2f}s, median "
        f"{statistics.median(times):.2f}s, worst {times[-1]:.2f}s (goal < 3 s); "
        f"bare interpreter start {base:.2f}s"
    )


if __name__ == "__main__":
    main()
