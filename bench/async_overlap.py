"""The quickstart at max_staleness 0, 1 and 2, side by side, in one run of this script.

Each setting is a real run (`rollflow run configs/quickstart.toml ...`: vLLM, trainer service,
Prefect flows) in a fresh folder; the table is read back from the runs' metrics Parquet:

- s/step: mean wall seconds per step (consecutive steps' step_s add up to the run's wall clock);
- trainer idle: share of the wall clock the trainer waited for data (trainer_wait_for_data_s);
- producer blocked: share of the wall clock the producer had free capacity but was held back by
  the staleness bound (producer_blocked_s);
- staleness: mean and max of (step - 1 - version_started) over the trained groups;
- final reward: held-out reward at the last step (the quickstart starts at ~0.50).

    .venv/bin/python bench/async_overlap.py                 # 60 steps each (~15 min in all)
    .venv/bin/python bench/async_overlap.py --steps 20 --staleness 0 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]


def run_one(storage: Path, staleness: int, steps: int, extra: list[str]) -> dict:
    name = f"async-s{staleness}"
    cmd = [
        sys.executable,
        "-m",
        "rollflow.cli",
        "run",
        "configs/quickstart.toml",
        f"run.name={name}",
        f"run.storage={storage}",
        f"run.num_steps={steps}",
        f"train.max_staleness={staleness}",
        "run.eval_every=0",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PREFECT_HOME": str(storage / "prefect")},
    )
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"S={staleness} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    m = duckdb.sql(
        f"select * from read_parquet('{storage}/{name}/metrics/*.parquet', union_by_name=true) "
        "order by step"
    ).df()
    steps_m = m[m.step > 0]
    stale = duckdb.sql(
        f"select avg(step - 1 - version_started), max(step - 1 - version_started) "
        f"from read_parquet('{storage}/{name}/rollouts/*/*.parquet')"
    ).fetchall()[0]
    train_wall = steps_m.step_s.sum()
    return {
        "S": staleness,
        "steps": len(steps_m),
        "s_per_step": steps_m.step_s.mean(),
        "trainer_idle": steps_m.trainer_wait_for_data_s.sum() / train_wall,
        "producer_blocked": steps_m.producer_blocked_s.iloc[-1] / train_wall,
        "train_s": steps_m.train_phase_s.mean(),
        "stale_mean": stale[0],
        "stale_max": stale[1],
        "dropped": int(steps_m.get("stale_dropped_total", steps_m.step * 0).max() or 0),
        "start_reward": m.eval_reward.iloc[0],
        "final_reward": m.eval_reward.dropna().iloc[-1],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-") as tmp:
        rows = []
        for s in args.staleness:
            rows.append(run_one(Path(tmp), s, args.steps, args.overrides))
            print(f"S={s} done in {rows[-1]['wall_s']:.0f}s", flush=True)
    base = rows[0]["s_per_step"]
    print(f"\nquickstart, {args.steps} steps, {os.cpu_count()} CPUs")
    print(
        "| max_staleness | s/step | vs S=0 | trainer idle | producer blocked | train s/step | "
        "staleness mean/max | stale dropped | held-out reward start → end | run wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['S']} | {r['s_per_step']:.2f} | {r['s_per_step'] / base:.2f}× | {r['trainer_idle']:.0%} | "
            f"{r['producer_blocked']:.0%} | {r['train_s']:.2f} | {r['stale_mean']:.2f} / {r['stale_max']} | "
            f"{r['dropped']} | {r['start_reward']:.3f} → {r['final_reward']:.3f} | {r['wall_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
