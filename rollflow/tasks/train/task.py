"""The train stage: one optimizer step per mini-batch on the trainer service."""

from __future__ import annotations

import time
from statistics import fmean

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.http import call


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(ctx: RunContext, step: int, minibatches: list[list[int]]) -> dict:
    """forward_backward then optim_step for each mini-batch of groups; metrics averaged."""
    cfg = ctx.config
    timeout_s = cfg.trainer.request_timeout_s
    start = time.perf_counter()
    results = []
    for groups in minibatches:
        fb = call(ctx.trainer, "/forward_backward",
                  {"step": step, "group_indices": groups, "eps_low": cfg.train.clip_eps_low,
                   "eps_high": cfg.train.clip_eps_high}, timeout_s=timeout_s)
        fb.update(call(ctx.trainer, "/optim_step", timeout_s=timeout_s))
        results.append(fb)
    keys = ("loss", "grad_norm", "clip_fraction", "mismatch_kl", "neg_logprob_mean")
    metrics = {k: fmean(r[k] for r in results) for k in keys} if results else {}
    metrics["num_optim_steps"] = len(results)
    metrics["num_loss_tokens"] = sum(r["num_loss_tokens"] for r in results)
    # The trainer publishes training_finished after the run's last step (even one with no data).
    call(ctx.trainer, "/end_step", {"step": step}, timeout_s=timeout_s)
    metrics["train_s"] = time.perf_counter() - start
    return metrics


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint(ctx: RunContext, step: int) -> dict:
    """Save model, optimizer and trainer state to ``checkpoints/step=N``: the step's commit point."""
    return call(ctx.trainer, "/checkpoint", {"step": step}, timeout_s=ctx.config.trainer.request_timeout_s)
