"""The train stage: the algorithm's loop over epochs and mini-batches, on the trainer service.

Mini-batches and epochs live here, never in the ranks: each mini-batch is one
``forward_backward`` (the service splits it over ranks and micro-batches) and one ``optim_step``.
With ``train.old_logprobs = "trainer"`` a ``forward`` pass first records the trainer's own
log-probs of the whole batch, before any optimizer step of this outer step, as the ratio's
denominator (and TIS then reweights by trainer / sampler).
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.http import call
from rollflow.tasks.train.metrics import summarize_optimizer_steps


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(ctx: RunContext, step: int, minibatches: list[list[int]]) -> dict:
    """For each epoch, for each mini-batch of groups: forward_backward then optim_step."""
    t = ctx.config.train
    timeout_s = ctx.config.trainer.request_timeout_s
    start = time.perf_counter()
    loss = {"kind": t.loss, "eps_low": t.clip_eps_low, "eps_high": t.clip_eps_high, "tis_cap": t.tis_cap,
            "kl_coef": t.kl_coef, "entropy_coef": t.entropy_coef}
    metrics: dict[str, float] = {}
    if t.old_logprobs == "trainer" and minibatches:
        groups = sorted({g for mb in minibatches for g in mb})
        metrics["forward_s"] = call(ctx.trainer, "/forward", {"step": step, "group_indices": groups},
                                    timeout_s=timeout_s)["forward_s"]
    results = []
    for _ in range(t.num_epochs):
        for groups in minibatches:
            fb = call(ctx.trainer, "/forward_backward",
                      {"step": step, "group_indices": groups, "loss": loss, "old_logprobs": t.old_logprobs},
                      timeout_s=timeout_s)
            fb.update(call(ctx.trainer, "/optim_step", timeout_s=timeout_s))
            results.append(fb)
    metrics.update(summarize_optimizer_steps(results))
    # The trainer publishes training_finished after the run's last step (even one with no data).
    call(ctx.trainer, "/end_step", {"step": step}, timeout_s=timeout_s)
    metrics["train_s"] = time.perf_counter() - start
    return metrics


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint(ctx: RunContext, step: int) -> dict:
    """Save model, optimizer, schedule, RNG and step to ``checkpoints/step=N``: the step's commit point."""
    return call(ctx.trainer, "/save_checkpoint", {"step": step}, timeout_s=ctx.config.trainer.request_timeout_s)
