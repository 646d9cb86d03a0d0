"""What a TRL user does, end to end (issue 40, docs/guides/your-own-task.md): a JSONL of
chat-message prompts with an answer column, the page's `rewards.py` (one plain function in TRL's
form), a chat model of a real architecture (a tiny Llama whose tokenizer has a chat template),
`rollflow run` given five keys, then `rollflow status` as the page shows it.

The run rides on the suite's shared vLLM server (conftest.py's ``vllm_server``), as a TRL user's
``vllm_mode="server"`` run samples from a `trl vllm-serve` started apart: the environment names
it (``ROLLFLOW_VLLM_URLS``, ``ROLLFLOW_VLLM_KEY``), and the run replaces the weights it serves
(the session's first model) with its trainer's before the first sample. So the model is that
model's architecture and vocabulary: the character Llama, its tokenizer given a chat template in
its own characters (``role: content<eos>``, then ``assistant: ``). Afterwards the server gets
the session's weights back.

The task: "say red (412)" → "red", one of six words, the number a nonce that makes every prompt
its own. The model is warm-started as an instruct model would come, knowing half the task: 80
supervised steps on prompts of the task's form (nonces the data does not use), the first three
words answered right, the other three right a fifth of the time and else with one of the first
three. Greedy, it answers 0.58 of the 43 held-out prompts right (the first three words); sampled,
it is sometimes right on the others, which GRPO at the defaults (lr 1e-4, 8 completions a prompt,
40 steps) makes its answer: held-out 0.58 → 0.79 by step 20 (measured once, 2026-12-06, on two
busy cores). The bar, ``THRESHOLD``, is five held-out prompts more than the warm start's; the
warm start's own figure at step 0 shows that the server sampled the trainer's policy (the
server's own, random weights answer none right).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from rollflow.infra.models.tiny import add_chat_template
from rollflow.infra.vllm_fleet import keys

from conftest import restore_weights
from run_support import env_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "guides" / "your-own-task.md"
WORDS = ("yes", "no", "red", "blue", "cat", "dog")
THRESHOLD = 0.68  # held-out reward after step 0; the warm start's is 0.58 (25 of 43 prompts)
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
            "prompt": [{"role": "user", "content": f"say {WORDS[i % len(WORDS)]} ({n})"}],
            "answer": WORDS[i % len(WORDS)],
        }
        for i, n in enumerate(nonces)
    ]


def warm_start_format(model_dir: Path, steps: int = 80, right: float = 0.2) -> None:
    """Supervised steps on prompts of the task's form (then EOS), every prompt new (nonces the
    data does not use), labelled as a model that knows half the task would answer: the first
    three words right, the others right ``right`` of the time, else one of the first three."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 14 s; on two threads of two busy cores, 59 s
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        batch = []
        for _ in range(16):
            word = rng.choice(WORDS)
            content = f"say {word} ({rng.randrange(1000, 10000)})"
            if word in WORDS[3:] and rng.random() >= right:
                word = rng.choice(WORDS[:3])
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
    torch.set_num_threads(threads)
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory, vllm_server, vllm_model_dirs):
    """The user's folder after `rollflow run task.toml` and `rollflow status --config task.toml`
    in it, the run on the shared vLLM server: (folder, run's output, status's output)."""
    home = tmp_path_factory.mktemp("own")
    data = rows(seed=1)
    (home / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (home / "rewards.py").write_text(page_file("rewards.py"))
    (home / "task.toml").write_text(CONFIG)
    model = add_chat_template(shutil.copytree(vllm_model_dirs[0], home / "model"))
    warm_start_format(model)
    env = env_for(home)
    env.update(ROLLFLOW_VLLM_URLS=vllm_server.url, ROLLFLOW_VLLM_KEY=keys.key_for(vllm_server.url))
    outs = []
    try:
        for command in (["run", "task.toml"], ["status", "--config", "task.toml"]):
            proc = subprocess.run(
                [sys.executable, "-m", "rollflow.cli", *command],
                capture_output=True,
                text=True,
                timeout=600,
                env=env,
                cwd=home,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            outs.append(proc.stdout)
    finally:
        restore_weights(vllm_server, vllm_model_dirs[0])  # the session's policy for the next
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
    assert start <= 0.65, f"the warm start already knew the task ({start})"
    # The server's own weights (random) answer none right: it sampled the trainer's policy.
    assert start >= 0.15, f"step 0's held-out reward {start}: not the warm start's policy"
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
