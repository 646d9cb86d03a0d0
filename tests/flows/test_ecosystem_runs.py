"""A few training steps on one task of each ecosystem, through the config examples (the CLI,
vLLM, the trainer, Prefect), on a tiny Qwen3 chat model. Each runs only where its package is
installed: neither is a rollflow dependency (see docs/environments.md)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.infra.models.chat import save_tiny_chat_model
from rollflow.infra.storage import RunStorage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "run.num_steps=2",
    "run.eval_every=0",
    "sampling.group_size=4",
    "sampling.max_tokens=16",
    "sampling.num_eval_prompts=4",
    "train.train_batch_size=4",
    "train.mini_batch_size=4",
    "train.max_staleness=0",
    "train.filter_zero_advantage=false",
    "metrics.sinks=[]",
]


def _run(tmp_path: Path, example: str, env_args: str) -> RunStorage:
    """The example config with its env's args replaced, made small, on a tiny model."""
    model = save_tiny_chat_model("qwen3", tmp_path / "qwen3", seed=0)
    text = (ROOT / "configs" / "examples" / f"{example}.toml").read_text()
    config = tmp_path / f"{example}.toml"
    config.write_text(re.sub(r"(?m)^args = .*$", f"args = {env_args}", text, count=1))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "flows"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow.cli",
            "run",
            str(config),
            f"model.path={model}",
            f"run.storage={tmp_path / 'runs'}",
            "run.name=eco",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    storage = RunStorage(str(tmp_path / "runs"), "eco")
    assert storage.committed_steps("checkpoints") == [1, 2]
    return storage


@pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym is not installed"
)
def test_reasoning_gym_task_trains(tmp_path):
    storage = _run(
        tmp_path, "reasoning_gym", "{ dataset = 'leg_counting', size = 64, eval_size = 8 }"
    )
    rows = storage.read_step_table("rollouts", 1).to_pylist()
    assert rows and all(r["error"] is None and r["reward"] is not None for r in rows)


@pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None, reason="verifiers is not installed"
)
def test_verifiers_env_trains(tmp_path):
    storage = _run(
        tmp_path,
        "verifiers",
        "{ taskset = 'vf-tiny-env', max_turns = 2, max_total_tokens = 64 }",
    )
    rows = storage.read_step_table("rollouts", 1).to_pylist()
    assert rows and all(r["error"] is None and r["reward"] in (0.0, 1.0) for r in rows)
    # The env's "Are you sure?" turn: in the sequence, out of the loss.
    for r in rows:
        assert r["turn_roles"] == ["assistant", "user", "assistant"], r["stop_reason"]
        model, env, model2 = zip(r["turn_offsets"], [*r["turn_offsets"][1:], None], strict=True)
        mask = r["completion_mask"]
        assert set(mask[model[0] : model[1]]) == set(mask[model2[0] :]) == {1}
        assert set(mask[env[0] : env[1]]) == {0}
