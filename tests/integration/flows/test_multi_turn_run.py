"""A multi-turn run end to end: the real CLI, vLLM, the trainer, Prefect, on a tiny Qwen3 chat
model with the guessing game and the tool-calling calculator, sampled at temperature 0.7 /
top_p 0.9 with a system prompt from the config.

Checked from what the run committed:
- the rollouts' mask, token by token: every environment turn (the game's replies, tool
  results, chat headers) is 0 with log-prob 0.0, every model turn 1, and the turns tile the
  completion;
- the trainer's first-step loss equals a masked loss computed by hand with transformers from
  the committed batch (PPO + an entropy bonus at the sampling behaviour), and differs from the
  same loss over every token, so the mask is what makes them agree;
- the trainer counts only the model's tokens, and its log-probs match vLLM's (mismatch KL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.gpu_kernels.logprobs import reference_logprobs_entropy
from rollflow.infra.models.chat import save_tiny_chat_model
from rollflow.infra.storage import RunStorage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
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
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PREFECT_HOME": str(root / "prefect"), "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_rollouts_mask_every_environment_token(run_dir):
    storage = RunStorage(str(run_dir / "runs"), "mt")
    rows = storage.read_step_table("rollouts", 1).to_pylist()
    rows += storage.read_step_table("rollouts", 2).to_pylist()
    env_tokens = 0
    for r in rows:
        assert r["error"] is None, r["error"]
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
    assert any(r["num_turns"] > 1 for r in rows)


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
        mask_N = torch.tensor(r["completion_mask"], dtype=torch.float64)
        sums["masked"] += float((loss_N.double() * mask_N).sum())
        counts["masked"] += int(mask_N.sum())
        sums["all"] += float(loss_N.double().sum())
        counts["all"] += len(completion)
    return sums["masked"] / counts["masked"], sums["all"] / counts["all"]


def test_each_steps_loss_is_the_hand_computed_masked_loss(run_dir):
    storage = RunStorage(str(run_dir / "runs"), "mt")
    with_env_tokens = 0
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
        assert metrics["loss"] == pytest.approx(masked, abs=2e-5)
        assert metrics["num_loss_tokens"] == sum(sum(r["completion_mask"]) for r in batch)
        assert metrics["mismatch_kl"] < 1e-3
        if any(0 in r["completion_mask"] for r in batch):
            with_env_tokens += 1
            assert abs(metrics["loss"] - unmasked) > 1e-4
    assert with_env_tokens, "no batch held environment tokens: the masked loss was not tested"


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
    assert {g[0] for g in got} <= {"guess_number", "calculator"} and got
    info = json.loads(
        duckdb.sql(
            f"select info from read_parquet('{rollouts}/*/*.parquet') where num_turns > 1 limit 1"
        ).fetchall()[0][0]
    )
    messages = json.loads(info["messages"])
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are")
