"""One outer training step as one Prefect flow run: generate → advantage → train → sync.

Step flows overlap (see ``rl_run.run_steps``): step N+1's flow takes its groups from the rollout
producer while step N trains, never further ahead than ``max_staleness``. Two orders hold:
step N trains once step N-1 released the trainer, the moment its weights are out (after its
checkpoint or evaluation, when it has one: those must see step N-1's weights); and step N
commits after step N-1 committed. So step N-1's metrics and commit run while step N trains.
The step commits when its checkpoint's ``_SUCCESS`` is written; a step killed before that is
redone on resume, and its half-written folders are replaced, not added to.
"""

from __future__ import annotations

import time

from prefect import flow

from rollflow.flows.artifacts import publish_step_metrics
from rollflow.infra.context import RunContext
from rollflow.infra.events import publish
from rollflow.tasks.advantage.task import advantage
from rollflow.tasks.generate.host import host_for
from rollflow.tasks.generate.task import evaluate, generate, take_timeout_s
from rollflow.tasks.sync.task import sync
from rollflow.tasks.train.task import checkpoint, train

PRODUCER_METRICS = ("staleness_mean", "staleness_max", "stale_dropped_total", "groups_in_flight",
                    "producer_blocked_s", "loop_lag_p50_s", "loop_lag_p99_s", "loop_lag_max_s",
                    "retries_total", "inference_restarts")


@flow(name="train-step", flow_run_name="{ctx.config.run.name}-step-{step}", persist_result=False,
      validate_parameters=False)
def train_step(ctx: RunContext, step: int) -> dict:
    """Run step ``step``: its groups were sampled by versions ≥ step - 1 - max_staleness."""
    cfg = ctx.config
    host = host_for(cfg.run.name)
    t0 = time.perf_counter()
    rollouts = generate(ctx, step)
    t1 = time.perf_counter()
    batch = advantage(ctx, step, reuse=rollouts["reused"], group_scored_envs=rollouts["group_scored_envs"])
    t2 = time.perf_counter()
    trainer_free_at = host.wait_released(step - 1, take_timeout_s(cfg))
    t3 = time.perf_counter()
    trained = train(ctx, step, batch["minibatches"])
    t4 = time.perf_counter()
    evaluates = step == cfg.run.num_steps or bool(cfg.run.eval_every and step % cfg.run.eval_every == 0)
    checkpoints = step % cfg.run.checkpoint_every == 0 or step == cfg.run.num_steps
    synced = {}
    if step % cfg.train.sync_every == 0 or evaluates:
        synced = sync(ctx, version=step)
        host.set_version(step)  # vLLM serves it now: the producer admits the groups it unblocks
    t5 = time.perf_counter()
    if not (evaluates or checkpoints):
        host.release(step)
    metrics = {
        "reward_mean": rollouts["reward_mean"],
        **{f"reward/{env}": r for env, r in rollouts["reward_by_env"].items()},
        "num_rollouts": rollouts["num_rollouts"], "num_errors": rollouts["num_errors"],
        "rollouts_reused": rollouts["reused"], "num_skipped_rows": rollouts["num_skipped_rows"],
        "num_groups_kept": batch["num_groups_kept"], "num_samples_kept": batch["num_samples_kept"],
        "num_failed_samples": batch.get("num_failed_samples"),
        **{k: v for k, v in trained.items() if not isinstance(v, dict)},
        "sync_s": synced.get("total_s"), "sync_pause_s": synced.get("pause_s"),
        **{k: rollouts[k] for k in PRODUCER_METRICS if k in rollouts},
        # Wall clock by phase. The trainer waited for data from the moment it was free (the
        # previous step released it) until this step's batch was ready.
        "generate_phase_s": t1 - t0, "advantage_phase_s": t2 - t1, "train_phase_s": t4 - t3,
        "sync_phase_s": t5 - t4, "trainer_wait_for_data_s": max(0.0, t2 - trainer_free_at),
        "wait_for_previous_step_s": t3 - t2,
    }
    if evaluates:
        t_eval = time.perf_counter()
        ev = evaluate(ctx)
        metrics["eval_phase_s"] = time.perf_counter() - t_eval
        metrics["eval_reward"] = ev["eval_reward"]
        metrics.update({f"eval_reward/{e}": r for e, r in ev["eval_reward_by_env"].items()})
    host.wait_committed(step - 1, take_timeout_s(cfg))
    metrics["flow_s"] = time.perf_counter() - t0
    metrics["step_s"] = host.step_seconds()  # consecutive steps add up to the run's wall clock
    ctx.storage.write_metrics(step, metrics)
    if checkpoints:
        checkpoint(ctx, step)
    host.release(step)  # (again, for a step that released already: a no-op)
    publish(ctx.storage, "step_committed", step=step)
    host.mark_committed(step)
    # For people, after the commit: the artifact is a call to the Prefect API that the next
    # step's trainer must not wait for.
    publish_step_metrics(cfg.run.name, step, metrics)
    return metrics
