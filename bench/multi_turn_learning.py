"""Does a tiny chat model learn a multi-turn game with rollflow on CPU? Held-out reward, before
and after RL, on `guess_number` (guess a secret in [1, high], told "higher" or "lower").

1. Build a tiny random Qwen3 chat model (byte-level BPE, ChatML) and warm-start it by supervised
   training on game transcripts of a *feedback-blind* player: it says a random number it has not
   said yet each turn and ignores "higher" / "lower" (the loss on its own turns only: the same
   mask RL uses). That teaches the format (one number, then end of turn), not the strategy.
2. Run rollflow (the real CLI: vLLM, the trainer, Prefect) with GRPO on the game for
   `--minutes` of wall clock (the run's steps are sized to fit), evaluating held-out secrets
   greedily at the start and every few steps.
3. Print the held-out reward at step 0 (after the warm start) and the best and last later
   evaluations, with the wall clock. The claim is the rise: last - step 0.

    .venv/bin/python bench/multi_turn_learning.py [--minutes 12] [--high 4] [--out /tmp/mtl]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflow.infra.models.tiny_chat import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Guess my number between 1 and {high}. Say one number."

CONFIG = """
[run]
name = "mtl"
storage = "{storage}"
num_steps = {steps}
eval_every = {eval_every}
checkpoint_every = 1000

[model]
path = "{model}"

[[envs]]
name = "guess_number"
args = {{ high = {high}, max_turns = {max_turns}, max_total_tokens = 64, discount = {discount} }}

[sampling]
group_size = 8
max_tokens = 4
temperature = 1.0
num_eval_prompts = 64

[train]
lr = {lr}
train_batch_size = 16
mini_batch_size = 16
max_staleness = 1

[metrics]
sinks = []
"""


def transcripts(tok, high: int, max_turns: int, count: int, seed: int):
    """(ids, mask) of games played by a feedback-blind random guesser, in the chat format."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        secret = rng.randint(1, high)
        guesses = rng.sample(range(1, high + 1), high)[:max_turns]
        messages = [{"role": "user", "content": PROMPT.format(high=high)}]
        for g in guesses:
            messages.append({"role": "assistant", "content": str(g)})
            if g == secret:
                break
            messages.append({"role": "user", "content": "higher" if g < secret else "lower"})
        if messages[-1]["role"] == "user":
            messages.pop()
        # Turn by turn, as rollflow builds an episode: the model's tokens end with its end of
        # turn; what the template writes after it (a newline) opens the next, unmasked, turn.
        ids, mask, text, carry = [], [], "", ""
        for k in range(1, len(messages) + 1):
            is_model = messages[k - 1]["role"] == "assistant"
            full = tok.apply_chat_template(
                messages[:k], tokenize=False, add_generation_prompt=not is_model
            )
            delta, text = carry + full[len(text) :], full
            carry = ""
            if is_model and delta.endswith("\n"):
                delta, carry = delta[:-1], "\n"
            new = tok(delta, add_special_tokens=False).input_ids
            ids += new
            mask += [int(is_model)] * len(new)
        out.append((ids, mask))
    return out


def warm_start(model_dir: Path, high: int, max_turns: int, steps: int) -> float:
    """Supervised steps on blind-guesser games (model tokens only); returns the final loss."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    games = transcripts(tok, high, max_turns, 4000, seed=0)
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch = random.Random(step).sample(games, 32)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
        logits = model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0, help="wall clock of the RL run")
    parser.add_argument("--high", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--warm-steps", type=int, default=300)
    parser.add_argument(
        "--steps", type=int, default=40, help="RL steps (the run stops early at --minutes)"
    )
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--no-discount", action="store_true", help="reward 1 for any solved game (not by turns)"
    )
    parser.add_argument("--out", default="/tmp/rollflow-mtl")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    model_dir = save_tiny_chat_model("qwen3", out / "model", seed=0, max_position_embeddings=256)
    loss = warm_start(model_dir, args.high, args.max_turns, args.warm_steps)
    warm_s = time.monotonic() - start
    print(f"warm start: {args.warm_steps} steps, final loss {loss:.3f}, {warm_s:.0f}s")
    config = out / "mtl.toml"
    config.write_text(
        CONFIG.format(
            storage=out / "runs",
            steps=args.steps,
            eval_every=5,
            model=model_dir,
            high=args.high,
            max_turns=args.max_turns,
            lr=args.lr,
            discount=str(not args.no_discount).lower(),
        )
    )
    env = {**os.environ, "PREFECT_HOME": str(out / "prefect"), "PYTHONUNBUFFERED": "1"}
    run_start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflow.cli", "run", str(config)],
        cwd=ROOT,
        env=env,
        stdout=open(out / "run.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        proc.wait(timeout=args.minutes * 60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the run's services die with it; committed steps stay
        proc.wait(timeout=60)
    run_s = time.monotonic() - run_start
    metrics = duckdb.sql(
        f"select step, eval_reward, reward_mean, turns_mean from read_parquet("
        f"'{out}/runs/mtl/metrics/*.parquet', union_by_name = true) order by step"
    ).fetchall()
    evals = [(s, e) for s, e, _, _ in metrics if e is not None]
    print(f"RL run: {run_s:.0f}s, {max(s for s, *_ in metrics)} steps committed")
    print("step  eval_reward  train_reward  turns/episode")
    for s, e, r, t in metrics:
        print(
            f"{s:4d}  {'' if e is None else f'{e:.3f}':>11}  {'' if r is None else f'{r:.3f}':>12}  {'' if t is None else f'{t:.2f}':>13}"
        )
    if len(evals) >= 2:
        first, last = evals[0][1], evals[-1][1]
        print(
            f"held-out reward: step 0 {first:.3f} -> step {evals[-1][0]} {last:.3f} "
            f"(rise {last - first:+.3f}; best {max(e for _, e in evals[1:]):.3f}); "
            f"total wall clock {time.monotonic() - start:.0f}s"
        )


if __name__ == "__main__":
    main()
