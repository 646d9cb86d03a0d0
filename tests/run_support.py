"""Shared by the end-to-end run tests: a small config, the CLI in a subprocess, the layout check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = """
[run]
name = "{name}"
storage = "{storage}"
num_steps = {steps}
eval_every = 2

[model]
warm_start_target = 0.3
warm_start_max_steps = 50
cache_dir = "{cache}"

[model.tiny]
hidden_size = 64
num_heads = 2
intermediate_size = 128

[[envs]]
name = "sort_letters"

[[envs]]
name = "add"
args = {{ max_value = 9 }}

[sampling]
group_size = 4
max_tokens = 6
num_eval_prompts = 16

[train]
lr = 1e-4
train_batch_size = 8
mini_batch_size = 4
"""


def write_config(
    tmp_path: Path, cache: Path, name: str = "small", steps: int = 4, storage: str | None = None
) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        SMALL.format(name=name, storage=storage or tmp_path / "runs", steps=steps, cache=cache)
    )
    return path


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}


def run_cli(config: Path, tmp_path: Path, *overrides: str, timeout: float = 420) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_for(tmp_path),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def assert_every_step_once(run_dir: Path, steps: int) -> None:
    import duckdb

    for kind in ("rollouts", "batches", "checkpoints"):
        found = sorted(p.name for p in (run_dir / kind).iterdir())
        assert found == sorted(f"step={s}" for s in range(1, steps + 1)), (kind, found)
        for s in range(1, steps + 1):
            assert (run_dir / kind / f"step={s}" / "_SUCCESS").exists()
    rows = duckdb.sql(
        f"select step, count(*) n, count(distinct group_index) g from "
        f"read_parquet('{run_dir}/rollouts/*/*.parquet', hive_partitioning=true) group by step order by step"
    ).fetchall()
    assert rows == [(s, 32, 8) for s in range(1, steps + 1)]
