"""One outer training step as one Prefect flow run: generate → advantage → train → sync.

The step commits when its checkpoint's ``_SUCCESS`` is written (the last thing it does); a step
killed before that is redone on resume, and its half-written folders are replaced, not added to.
"""

from __future__ import annotations

import time

from prefect import flow

from rollflow.flows.artifacts import publish_step_metrics
from rollflow.infra.context import RunContext
from rollflow.tasks.advantage.task import advantage
from rollflow.tasks.generate.task import evaluate, generate
from rollflow.tasks.sync.task import sync
from rollflow.tasks.train.task import checkpoint, train


@flow(name="train-step", flow_run_name="{ctx.config.run.name}-step-{step}", persist_result=False,
      validate_parameters=False)
def train_step(ctx: RunContext, step: int, resumed_from: int) -> dict:
    """Run step ``step`` with the policy of version ``step - 1``; returns its metrics row."""
    cfg = ctx.config
    t0 = time.perf_counter()
    rollouts = generate(ctx, step, version=step - 1, resumed_from=resumed_from)
    t1 = time.perf_counter()
    batch = advantage(ctx, step, reuse=rollouts["reused"])
    t2 = time.perf_counter()
    trained = train(ctx, step, batch["minibatches"])
    t3 = time.perf_counter()
    synced = sync(ctx, version=step)
    t4 = time.perf_counter()
    metrics = {
        "reward_mean": rollouts["reward_mean"],
        **{f"reward/{env}": r for env, r in rollouts["reward_by_env"].items()},
        "num_rollouts": rollouts["num_rollouts"], "num_errors": rollouts["num_errors"],
        "rollouts_reused": rollouts["reused"], "retries": rollouts.get("retries", 0),
        "num_groups_kept": batch["num_groups_kept"], "num_samples_kept": batch["num_samples_kept"],
        **{k: v for k, v in trained.items() if not isinstance(v, dict)},
        "sync_s": synced.get("total_s"), "sync_pause_s": synced.get("pause_s"),
        "generate_phase_s": t1 - t0, "advantage_phase_s": t2 - t1, "train_phase_s": t3 - t2,
        "sync_phase_s": t4 - t3,
    }
    if step == cfg.run.num_steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
        ev = evaluate(ctx)
        metrics["eval_reward"] = ev["eval_reward"]
        metrics.update({f"eval_reward/{e}": r for e, r in ev["eval_reward_by_env"].items()})
    metrics["step_s"] = time.perf_counter() - t0
    ctx.storage.write_metrics(step, metrics)
    publish_step_metrics(cfg.run.name, step, metrics)
    if step % cfg.run.checkpoint_every == 0 or step == cfg.run.num_steps:
        checkpoint(ctx, step)
    ctx.storage.append_event("step_committed", step=step)
    return metrics
