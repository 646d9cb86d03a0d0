"""A mixed multi-turn run end to end: the real CLI, vLLM, the trainer, Prefect, on a tiny Qwen3
chat model with the guessing game and the tool-calling calculator, and one task of each ecosystem
where its package is installed (reasoning-gym, verifiers: neither is a rollflow dependency, see
docs/environments.md), sampled at temperature 0.7 / top_p 0.9 with a system prompt from the
config. One run carries every check (the env mix's seeded draw puts all four envs in step 1).

Checked from what the run committed:
- the rollouts' mask, token by token: every environment turn (the game's replies, tool
  results, chat headers) is 0 with log-prob 0.0, every model turn 1, and the turns tile the
  completion;
- the trainer's first-step loss equals a masked loss computed by hand with transformers from
  the committed batch (PPO + an entropy bonus at the sampling behaviour), and differs from the
  same loss over every token, so the mask is what makes them agree;
- the trainer counts only the model's tokens, and its log-probs match vLLM's (mismatch KL);
- each ecosystem's task trains: its rollouts are scored, and the verifiers env's own turn is in
  the sequence and out of the loss. The example configs of both load (``--dry-run``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.cli import main
from rollflow.gpu_kernels.logprobs import reference_logprobs_entropy
from rollflow.infra.models.tiny_chat import save_tiny_chat_model
from rollflow.infra.storage import RunStorage

from run_support import env_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parents[2]  # vf_tiny_env.py, the verifiers taskset of the run
MULTI_TURN = ("guess_number", "calculator")
# Each ecosystem's env: the example config's env with small args, where its package is installed.
ECOSYSTEMS = {
    "reasoning_gym": "{ dataset = 'leg_counting', size = 64, eval_size = 8 }",
    "verifiers": "{ taskset = 'vf-tiny-env', max_turns = 2, max_total_tokens = 64 }",
}
INSTALLED = [name for name in ECOSYSTEMS if importlib.util.find_spec(name) is not None]
TEMPERATURE, TOP_P, ENTROPY_COEF, EPS = 0.7, 0.9, 0.01, 0.2
CONFIG = """
[run]
name = "mt"
storage = "{storage}"
num_steps = 2
eval_every = 0

[model]
path = "{model}"

[[envs]]
name = "guess_number"
weight = 3
args = {{ high = 8, max_turns = 3, max_total_tokens = 48 }}

[[envs]]
name = "calculator"
args = {{ max_turns = 2, max_total_tokens = 48 }}
{ecosystems}
[prompt]
system = "You are a careful assistant."

[sampling]
group_size = 4
max_tokens = 12
temperature = {temperature}
top_p = {top_p}
num_eval_prompts = 4

[train]
lr = 1e-4
train_batch_size = 4
mini_batch_size = 4
filter_zero_advantage = false

[train.loss]
entropy_coef = {entropy_coef}

[metrics]
sinks = []
"""


def _example(name: str) -> str:
    """The ecosystem's example config, its env's args made small."""
    text = (ROOT / "configs" / "examples" / f"{name}.toml").read_text()
    return re.sub(r"(?m)^args = .*$", f"args = {ECOSYSTEMS[name]}", text, count=1)


def _example_env(name: str) -> str:
    return tomllib.loads(_example(name))["envs"][0]["name"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mt")
    model = save_tiny_chat_model("qwen3", root / "qwen3", seed=0)
    config = root / "mt.toml"
    config.write_text(
        CONFIG.format(
            storage=root / "runs",
            model=model,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            entropy_coef=ENTROPY_COEF,
            ecosystems="".join(
                f'\n[[envs]]\nname = "{_example_env(name)}"\nargs = {ECOSYSTEMS[name]}\n'
                for name in INSTALLED
            ),
        )
    )
    env = env_for(root)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_rollouts_mask_every_environment_token(run_dir):
    storage = RunStorage(str(run_dir / "runs"), "mt")
    rows = storage.read_step_table("rollouts", 1).to_pylist()
    rows += storage.read_step_table("rollouts", 2).to_pylist()
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    env_tokens = 0
    for r in (r for r in rows if r["env"] in MULTI_TURN):
        n = len(r["completion_ids"])
        assert len(r["completion_mask"]) == len(r["completion_logprobs"]) == n
        bounds = [*r["turn_offsets"], n]
        assert bounds[0] == 0 and bounds == sorted(bounds)
        assert r["turn_roles"][0] == r["turn_roles"][-1] == "assistant"
        assert len(r["turn_versions"]) == len(r["turn_roles"])
        for k, role in enumerate(r["turn_roles"]):
            span = range(bounds[k], bounds[k + 1])
            if role == "assistant":
                assert all(r["completion_mask"][i] == 1 for i in span)
                assert all(r["completion_logprobs"][i] <= 0.0 for i in span)
            else:
                assert role in ("user", "tool")
                assert all(r["completion_mask"][i] == 0 for i in span)
                assert all(r["completion_logprobs"][i] == 0.0 for i in span)
                env_tokens += len(span)
        assert r["num_turns"] == r["turn_roles"].count("assistant")
        assert r["stop_reason"] in ("env_done", "max_turns", "max_total_tokens", "length")
        assert r["truncated"] == (r["stop_reason"] != "env_done" or r["finish_reason"] == "length")
        assert r["version_started"] <= min(r["turn_versions"])
    assert env_tokens > 0, "no episode had an environment turn: the mask was not exercised"
    assert any(r["num_turns"] > 1 for r in rows if r["env"] in MULTI_TURN)


def _mask(row: dict) -> list[int]:
    """The row's loss mask (a single-turn row may carry none: every token counts)."""
    return row["completion_mask"] or [1] * len(row["completion_ids"])


def _hand_loss(model, rows) -> tuple[float, float]:
    """(masked, unmasked) PPO + entropy-bonus token means over the batch, by hand."""
    sums = {"masked": 0.0, "all": 0.0}
    counts = {"masked": 0, "all": 0}
    weight = model.get_output_embeddings().weight
    for r in rows:
        prompt, completion = r["prompt_ids"], r["completion_ids"]
        with torch.no_grad():
            hidden = model.model(torch.tensor([prompt + completion])).last_hidden_state[0]
            hidden_N_H = hidden[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
            logp_N, entropy_N = reference_logprobs_entropy(
                hidden_N_H,
                weight,
                torch.tensor(completion),
                temperature=TEMPERATURE,
                top_p=TOP_P,
            )
        ratio_N = torch.exp(logp_N - torch.tensor(r["completion_logprobs"]))
        adv = r["advantage"]
        pg_N = -torch.minimum(ratio_N * adv, ratio_N.clamp(1 - EPS, 1 + EPS) * adv)
        loss_N = pg_N - ENTROPY_COEF * entropy_N
        mask_N = torch.tensor(_mask(r), dtype=torch.float64)
        sums["masked"] += float((loss_N.double() * mask_N).sum())
        counts["masked"] += int(mask_N.sum())
        sums["all"] += float(loss_N.double().sum())
        counts["all"] += len(completion)
    return sums["masked"] / counts["masked"], sums["all"] / counts["all"]


LOSS_TOLERANCE = 2e-5  # fp32 trainer against a float64 hand computation


def test_each_steps_loss_is_the_hand_computed_masked_loss(run_dir):
    storage = RunStorage(str(run_dir / "runs"), "mt")
    with_env_tokens = told_apart = 0
    for step in (1, 2):
        batch = storage.read_step_table("batches", step).to_pylist()
        metrics = pq.read_table(
            run_dir / "runs" / "mt" / "metrics" / f"step={step}.parquet"
        ).to_pylist()[0]
        # max_staleness = 0: step N trained the weights of step N - 1 on rollouts they sampled.
        assert all(r["version_started"] == step - 1 for r in batch)
        weights = run_dir / "qwen3" if step == 1 else storage.step_dir("checkpoints", step - 1)
        model = AutoModelForCausalLM.from_pretrained(weights).eval()
        masked, unmasked = _hand_loss(model, batch)
        print(
            f"\nstep {step}: trainer loss {metrics['loss']:.6f}, hand masked {masked:.6f}, "
            f"hand over every token {unmasked:.6f}; mismatch KL {metrics['mismatch_kl']:.2e}"
        )
        assert metrics["loss"] == pytest.approx(masked, abs=LOSS_TOLERANCE)
        assert metrics["num_loss_tokens"] == sum(sum(_mask(r)) for r in batch)
        assert metrics["mismatch_kl"] < 1e-3
        if any(0 in _mask(r) for r in batch):
            with_env_tokens += 1
        if abs(masked - unmasked) > 4 * LOSS_TOLERANCE:
            # This batch tells the masks apart: the loss over every token is farther from the
            # trainer's than the tolerance could explain. How far depends on the sampled batch
            # (8.6e-5 was seen; and 1.9e-6, where the environment tokens' mean loss was the
            # completion's, in a CI run that failed a fixed 2 * tolerance): at least one must.
            told_apart += 1
            assert abs(metrics["loss"] - unmasked) > 2 * LOSS_TOLERANCE
    assert with_env_tokens, "no batch held environment tokens: the masked loss was not tested"
    assert told_apart, "no batch told the masked loss from the loss over every token"


def test_per_turn_statistics_are_queryable_with_duckdb(run_dir):
    import duckdb

    rollouts = run_dir / "runs" / "mt" / "rollouts"
    got = duckdb.sql(
        f"""
        select env, count(*) as episodes, avg(num_turns) as turns,
               avg(len(completion_ids) - list_sum(completion_mask)) as env_tokens,
               avg(truncated::int) as truncated
        from read_parquet('{rollouts}/*/*.parquet', hive_partitioning = true)
        group by env order by env
        """
    ).fetchall()
    assert {g[0] for g in got} <= {*MULTI_TURN, *INSTALLED} and got
    info = json.loads(
        duckdb.sql(
            f"select info from read_parquet('{rollouts}/*/*.parquet') "
            f"where num_turns > 1 and env in {MULTI_TURN} limit 1"
        ).fetchall()[0][0]
    )
    messages = json.loads(info["messages"])
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are")


@pytest.mark.skipif("reasoning_gym" not in INSTALLED, reason="reasoning-gym is not installed")
def test_reasoning_gym_task_trains(run_dir):
    rows = [r for r in _rollouts(run_dir) if r["env"] == "reasoning_gym"]
    assert rows and all(r["error"] is None and r["reward"] is not None for r in rows)


@pytest.mark.skipif("verifiers" not in INSTALLED, reason="verifiers is not installed")
def test_verifiers_env_trains(run_dir):
    rows = [r for r in _rollouts(run_dir) if r["env"] == "verifiers"]
    assert rows and all(r["error"] is None and r["reward"] in (0.0, 1.0) for r in rows)
    # The env's "Are you sure?" turn: in the sequence, out of the loss.
    for r in rows:
        assert r["turn_roles"] == ["assistant", "user", "assistant"], r["stop_reason"]
        model, env, model2 = zip(r["turn_offsets"], [*r["turn_offsets"][1:], None], strict=True)
        mask = r["completion_mask"]
        assert set(mask[model[0] : model[1]]) == set(mask[model2[0] :]) == {1}
        assert set(mask[env[0] : env[1]]) == {0}


@pytest.mark.parametrize("name", INSTALLED)
def test_the_ecosystems_example_config_loads(name, tmp_path, monkeypatch, capsys):
    """The example config as the mixed run uses its env (small args): it passes --dry-run."""
    monkeypatch.syspath_prepend(str(TESTS))
    config = tmp_path / f"{name}.toml"
    config.write_text(_example(name))
    assert main(["run", str(config), "--dry-run", f"run.storage={tmp_path / 'runs'}"]) == 0
    assert f"env {_example_env(name)}: loads" in capsys.readouterr().err


def _rollouts(run_dir: Path) -> list[dict]:
    storage = RunStorage(str(run_dir / "runs"), "mt")
    return [r for step in (1, 2) for r in storage.read_step_table("rollouts", step).to_pylist()]
