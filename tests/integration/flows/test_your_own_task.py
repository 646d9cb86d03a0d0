"""What a TRL user does, end to end (issue 40, docs/guides/your-own-task.md): a JSONL of
chat-message prompts with an answer column, the page's `rewards.py` (one plain function in TRL's
form), a chat model of a real architecture (a tiny Qwen3 with Qwen's chat template, built here),
`rollflow run` given five keys, then `rollflow status` as the page shows it.

The task: "Say red. (412)" → "red", one of six words, the number a nonce that makes every prompt
its own. The model is warm-started as an instruct model would come: five supervised steps on
prompts of the task's form (nonces the data does not use), which teach the answer's form and a
little of the task: held-out greedy reward 0.385 (10 of 26 held-out prompts). GRPO at the
defaults (lr 1e-4, 8 completions a prompt, 40 steps) raised it in three measured runs: 0.615,
0.462 and 0.885 at step 40 (one run with train_batch_size = 16 instead fell, to 0.269). Where it ends varies: within ~10 steps the tiny model answers each prompt
the same way 8 times out of 8, those groups have no advantage and are dropped, and learning
stalls wherever it got to (the defaults have no entropy bonus, and five keys leave none to set).
So the bar is modest: above ``THRESHOLD``, at least one more held-out prompt right than the
warm start.

No external vLLM server: `rollflow run` starts its own (the CPU build), as every run test does;
it has no setting to use a server started elsewhere, and the suite's shared server
(conftest.py's ``vllm_server``) serves a character model without a chat template.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from rollflow.infra.models.tiny_chat import save_tiny_chat_model

from run_support import env_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "guides" / "your-own-task.md"
WORDS = ("yes", "no", "red", "blue", "cat", "dog")
THRESHOLD = 0.42  # held-out reward after step 0; the warm start's is 0.385 (10/26)
# Five keys, as a TRL user gives GRPOTrainer a model, reward_funcs, a dataset and a batch size.
CONFIG = """\
[model]
path = "model"

[[envs]]
name = "dataset"
args = { path = "data.jsonl" }
rewards = [{ fn = "rewards.py:accuracy" }]

[train]
train_batch_size = 8
"""


def page_file(title: str) -> str:
    """The page's block titled ``title`` (```lang title="rewards.py")."""
    found = re.search(rf'```\w+ title="{re.escape(title)}"\n(.*?)```', PAGE.read_text(), re.S)
    assert found, f"{PAGE.name} has no block titled {title}"
    return found.group(1)


def leaf_keys(table: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        if isinstance(value, dict):
            keys += leaf_keys(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                keys += [k for k in leaf_keys(item, f"{prefix}{key}.{i}.") if k]
        else:
            keys.append(prefix + key)
    return keys


def rows(seed: int) -> list[dict]:
    rng = random.Random(seed)
    nonces = rng.sample(range(100, 1000), 300)
    return [
        {
            "prompt": [{"role": "user", "content": f"Say {WORDS[i % len(WORDS)]}. ({n})"}],
            "answer": WORDS[i % len(WORDS)],
        }
        for i, n in enumerate(nonces)
    ]


def warm_start_format(model_dir: Path, steps: int = 5) -> None:
    """A few supervised steps on prompts of the task's form (then EOS), every prompt new (nonces
    the data does not use): the answer's form and a little of the task."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        batch = []
        for _ in range(16):
            word = rng.choice(WORDS)
            content = f"Say {word}. ({rng.randrange(1000, 10000)})"
            messages = [{"role": "user", "content": content}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            reply = tok(word + tok.eos_token, add_special_tokens=False)["input_ids"]
            batch.append((prompt, reply))
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The user's folder after `rollflow run task.toml` and `rollflow status --config task.toml`
    in it: (folder, run's output, status's output)."""
    home = tmp_path_factory.mktemp("own")
    data = rows(seed=1)
    (home / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (home / "rewards.py").write_text(page_file("rewards.py"))
    (home / "task.toml").write_text(CONFIG)
    warm_start_format(save_tiny_chat_model("qwen3", home / "model", seed=0))
    outs = []
    for command in (["run", "task.toml"], ["status", "--config", "task.toml"]):
        proc = subprocess.run(
            [sys.executable, "-m", "rollflow.cli", *command],
            capture_output=True,
            text=True,
            timeout=600,
            env=env_for(home),
            cwd=home,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outs.append(proc.stdout)
    return home, *outs


def test_five_keys_at_most():
    keys = leaf_keys(tomllib.loads(CONFIG))
    assert len(keys) <= 5, keys


def test_held_out_reward_rises_above_the_threshold(run):
    """Above the threshold at one of the run's held-out evaluations after step 0 (every 10
    steps): where learning stalls varies from run to run (the module's docstring), the rise
    does not."""
    home, out, status = run
    found = re.search(r"held-out reward ([\d.]+) \(step 0\) -> ([\d.]+) \(step (\d+)\)", out)
    assert found, out[-2000:]
    start, end = float(found.group(1)), float(found.group(2))
    assert start <= 0.45, f"the warm start already knew the task ({start})"
    [run_dir] = (home / "runs").iterdir()
    metrics = pd.concat(
        pd.read_parquet(p) for p in sorted((run_dir / "metrics").glob("step=*.parquet"))
    )
    evals = metrics.loc[metrics["step"] > 0, ["step", "eval_reward"]].dropna()
    assert len(evals) >= 2 and evals["eval_reward"].max() >= THRESHOLD, (evals, out[-3000:])
    assert f"{end:.3f}" in status  # `rollflow status` tables the same evaluation


def test_rows_carry_the_functions_value(run):
    """Each rollout row keeps the function's value (``info``'s ``rewards``), and each step's
    metrics its mean (``reward_fn/<env>/<function>``)."""
    home, _, _ = run
    [run_dir] = (home / "runs").iterdir()
    df = pd.read_parquet(run_dir / "rollouts", partitioning=None)
    values = pd.Series([json.loads(info)["rewards"]["accuracy"] for info in df["info"]])
    assert set(values) == {0.0, 1.0}
    assert (values == df["reward"]).all()  # one function of weight 1: it is the reward
    metrics = pd.read_parquet(run_dir / "metrics" / "step=1.parquet")
    step1 = df["step"] == 1
    assert metrics["reward_fn/dataset/accuracy"].iloc[0] == pytest.approx(values[step1].mean())
