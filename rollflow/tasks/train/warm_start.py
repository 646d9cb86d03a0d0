"""Supervised warm start of a tiny model, so that RL starts with signal.

A randomly initialised model never samples a correct answer, so every group has zero advantage.
The warm start trains on (prompt, answer) pairs of the train split until the held-out greedy
accuracy first reaches a target, then stops: RL has signal, and room to improve.

Built models are cached by a hash of everything that shapes them; a second run reuses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rollflow.infra.models.tiny import (
    EOS_ID,
    PAD_ID,
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_llama,
    save_hf_dir,
)

WARM_START_VERSION = 1  # bump when the procedure changes, to invalidate caches
# The warm start's torch threads. Its matrices are tiny (a batch of 64 short answers): a second
# thread buys little, and on shared cores its spinning barrier costs far more (25 steps of the
# quickstart's model at load ~11 on 2 cores: 1 thread 5.4 s wall / 1.5 s CPU, 2 threads 83.5 s
# wall / 21.9 s CPU; /tmp benchmark, 2026-12-06). The trainer's ranks set their own.
WARM_START_THREADS = 1
Pairs = list[tuple[str, str]]


def cache_key(spec: TinyModelSpec, recipe: dict) -> str:
    blob = json.dumps(
        {"v": WARM_START_VERSION, "spec": spec.model_dump(), "recipe": recipe}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_tiny_model(
    spec: TinyModelSpec,
    *,
    train_pairs: Pairs,
    eval_pairs: Pairs,
    target: float,
    max_steps: int,
    lr: float,
    cache_dir: str | Path,
    recipe: dict,
    progress: Callable[[str], None] = print,
) -> Path:
    """The path of a warm-started tiny model, built now or taken from the cache."""
    root = Path(cache_dir).expanduser()
    final = root / f"tiny-{cache_key(spec, recipe)}"
    if (final / "config.json").exists():
        progress(f"model: reusing cached warm-started tiny model {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".building-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_char_tokenizer(spec.alphabet)
    model = build_tiny_llama(spec, vocab_size=len(tokenizer))
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(WARM_START_THREADS)
    try:
        steps, acc = warm_start(
            model,
            tokenizer,
            train_pairs,
            eval_pairs,
            target=target,
            max_steps=max_steps,
            lr=lr,
            seed=spec.seed,
            progress=progress,
        )
    finally:
        torch.set_num_threads(threads)  # the run process's own setting again
    progress(
        f"model: warm start reached held-out accuracy {acc:.2f} after {steps} steps "
        f"({time.perf_counter() - start:.0f}s)"
    )
    save_hf_dir(model, tokenizer, tmp)
    (tmp / "warm_start.json").write_text(
        json.dumps({"steps": steps, "accuracy": acc, "recipe": recipe})
    )
    try:
        os.rename(tmp, final)  # atomic: a cached model is whole or absent
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def warm_start(
    model,
    tokenizer,
    train_pairs: Pairs,
    eval_pairs: Pairs,
    *,
    target: float,
    max_steps: int,
    lr: float,
    seed: int = 0,
    batch_size: int = 64,
    eval_every: int = 25,
    progress: Callable[[str], None] = print,
) -> tuple[int, float]:
    """Train on answers until held-out greedy accuracy >= target; returns (steps, accuracy)."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # Room for the longest answer and its eos: a fixed 8 tokens made longer answers unreachable.
    longest = max(len(tokenizer(a, add_special_tokens=False).input_ids) for _, a in eval_pairs) + 1
    acc = greedy_accuracy(model, tokenizer, eval_pairs, max_new_tokens=longest)
    step, shown = 0, time.monotonic()
    while acc < target and step < max_steps:
        model.train()
        for _ in range(eval_every):
            batch = rng.sample(train_pairs, min(batch_size, len(train_pairs)))
            loss = _answer_loss(model, tokenizer, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
        acc = greedy_accuracy(model, tokenizer, eval_pairs, max_new_tokens=longest)
        if time.monotonic() - shown >= 20:  # progress on long warm starts, quiet on short ones
            shown = time.monotonic()
            progress(
                f"model: warm start step {step}: held-out accuracy {acc:.2f} (target {target:.2f})"
            )
    model.eval()
    return step, acc


def _answer_loss(model, tokenizer, pairs: Pairs) -> torch.Tensor:
    """Cross-entropy on answer tokens (and eos) only."""
    seqs, starts = [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt).input_ids
        a = tokenizer(answer, add_special_tokens=False).input_ids + [EOS_ID]
        seqs.append(p + a)
        starts.append(len(p))
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), PAD_ID)
    labels = torch.full((len(seqs), T), -100)
    for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, st : len(s)] = torch.tensor(s[st:])
    return model(input_ids=ids, attention_mask=(ids != PAD_ID).long(), labels=labels).loss


@torch.no_grad()
def greedy_accuracy(model, tokenizer, pairs: Pairs, max_new_tokens: int = 8) -> float:
    """Exact-match accuracy of greedy completions (left-padded batch, decoded with the KV cache:
    recomputing the whole prefix per token cost ~20 s per evaluation of a 10M model)."""
    model.eval()
    prompts = [tokenizer(p).input_ids for p, _ in pairs]
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), PAD_ID)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        attn[i, P - len(p) :] = 1
    out = torch.zeros((len(prompts), 0), dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    past = None
    for _ in range(max_new_tokens):
        step = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=position_ids,
            past_key_values=past,
            use_cache=True,
        )
        past = step.past_key_values
        nxt = step.logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
        out = torch.cat([out, nxt[:, None]], 1)
        done |= nxt == EOS_ID
        if done.all():
            break
        ids = nxt[:, None]
        position_ids = position_ids[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(ids)], 1)
    correct = 0
    for row, (_, answer) in zip(out.tolist(), pairs, strict=True):
        text_ids = row[: row.index(EOS_ID)] if EOS_ID in row else row
        correct += tokenizer.decode(text_ids) == answer
    return correct / len(pairs)
