"""One outer training step as one Prefect flow run: generate → advantage → train → sync → commit.

Step flows overlap (see ``rl_run.run_steps``): step N+1's flow takes its groups from the rollout
producer while step N trains, never further ahead than ``max_staleness``. What a step does and
when it releases the trainer is one decision, its schedule (``order.StepSchedule``); the orders
hold (``order.StepOrder``): step N trains once step N-1 released the trainer: when its training ended
and its weights were captured for the sync (``trainer.background_sync``: the broadcast then runs
while step N trains), or after its checkpoint or evaluation, when it has one (those must see
step N-1's weights); step N's sync follows step N-1's; and step N commits after step N-1. So step N-1's metrics and commit run
while step N trains. The step commits when its checkpoint's ``_SUCCESS`` is written; a step
killed before that is redone on resume, and its half-written folders are replaced, not added to.

A fractional ``max_staleness`` (``train.sync_lag()`` = a > 0 optimizer steps) moves the sync into
the step: the train task keeps the weights a optimizer steps before its end, and the sync sends
them to vLLM as version ``N - a/n`` (n: the step's optimizer steps) while those a train, so
step N + 1's groups are sampled meanwhile from weights only a optimizer steps behind. A step
that evaluates syncs at its end instead (evaluation must see the step's whole weights).
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.utilities.annotations import quote

from rollflow.flows.artifacts import publish_step_metrics
from rollflow.flows.order import Phase, StepOrder
from rollflow.flows.step_metrics import StepMetrics
from rollflow.infra.context import RunContext
from rollflow.infra.events import Event, publish
from rollflow.infra.metric_names import Metric
from rollflow.tasks.advantage.advantage_task import Batch, advantage
from rollflow.tasks.generate.generate_task import evaluate, generate, take_timeout_s
from rollflow.tasks.generate.host import ProducerHost
from rollflow.tasks.sync.sync_task import Synced, sync
from rollflow.tasks.train.train_task import MidStepCapture, checkpoint, train, trainer_client


@flow(
    name="train-step",
    flow_run_name="{ctx.config.run.name}-step-{step}",
    persist_result=False,
    validate_parameters=False,
)
def train_step(ctx: RunContext, step: int, order: StepOrder, host: ProducerHost) -> dict:
    """Run step ``step``: its groups were sampled by versions ≥ step - 1 - max_staleness.
    ``order`` and ``host`` are the run flow's own (live objects: the UI shows their type)."""
    plan, deadline_s = order.schedule(step), take_timeout_s(ctx.config)
    m = StepMetrics()
    # Handed to each task as it is: Prefect would otherwise walk the whole config for task inputs
    # at every call (~1-2 ms of the run process's CPU per task, measured).
    run = quote(ctx)

    with m.timed(Metric.GENERATE_PHASE_S):
        rollouts = generate(run, step, quote(host))
    with m.timed(Metric.ADVANTAGE_PHASE_S):
        batch = advantage(
            run, step, reuse=rollouts.reused, group_scored_envs=rollouts.group_scored_envs
        )
    with m.timed(Metric.WAIT_FOR_PREVIOUS_STEP_S):
        m.record_trainer_wait(order.wait_trainer(step, deadline_s))
    order.trains(step)
    with m.timed(Metric.TRAIN_PHASE_S):
        if plan.lag:
            trained, synced = train_syncing_mid_step(ctx, step, batch, plan.lag, order, host)
        else:
            trained = train(
                run,
                step,
                batch.group_indices,
                quote(batch.sample_keys),
                num_loss_tokens=batch.num_loss_tokens,
            )
    if plan.captures:
        with m.timed(Metric.CAPTURE_S):
            trainer_client(ctx).weights_capture(step)  # the sync below sends this copy
    order.passed(step, Phase.TRAINED)  # the next step may train while the weights go out
    with m.timed(Metric.SYNC_PHASE_S):
        if not plan.lag:
            order.wait_sync_turn(step, deadline_s)
            synced = sync(run, step, trainer_client(ctx)) if plan.syncs else None
            order.synced(step)
            if synced:
                host.set_version(step)  # vLLM serves it: the producer admits what it unblocks
    order.passed(step, Phase.SYNCED)
    m.record_rollouts(rollouts)
    m.record_batch(batch)
    m.record_train(trained)
    m.record_sync(synced)
    m.record_trainer_restarts(ctx.trainer_restarts)
    if plan.evaluates:
        with m.timed(Metric.EVAL_PHASE_S):
            m.record_eval(evaluate(run))

    metrics = m.record_end(order.wait_commit_turn(step, deadline_s))
    ctx.storage.write_metrics(step, metrics)
    if plan.checkpoints:
        checkpoint(run, step)
    order.passed(step, Phase.CHECKPOINTED)
    publish(ctx.storage, Event.STEP_COMMITTED, step=step)
    order.committed(step)
    # For people, after the commit: the artifact is a call to the Prefect API that the next
    # step's trainer must not wait for.
    publish_step_metrics(ctx.config.run.name, step, metrics)
    return metrics


def train_step_in_turn(ctx: RunContext, step: int, order: StepOrder, host: ProducerHost) -> dict:
    """``train_step``, its flow run created in the start order (``StepOrder.wait_start_turn``)."""
    order.wait_start_turn(step, take_timeout_s(ctx.config))
    return train_step(ctx, step, order, host)


def train_syncing_mid_step(
    ctx: RunContext, step: int, batch: Batch, lag: int, order: StepOrder, host: ProducerHost
) -> tuple[dict, Synced]:
    """Train step ``step`` and, ``lag`` optimizer steps before its end, send its weights to vLLM
    as version ``step - behind / n`` while the rest trains (see the module docstring)."""
    deadline_s = take_timeout_s(ctx.config)
    run, capture = quote(ctx), MidStepCapture(lag)
    future = train.submit(
        run,
        step,
        batch.group_indices,
        quote(batch.sample_keys),
        quote(capture),
        num_loss_tokens=batch.num_loss_tokens,
    )
    deadline = time.monotonic() + deadline_s
    while not capture.done.wait(0.02):
        if future.wrapped_future.done():
            future.result()  # the train task failed before the capture: its error
            raise RuntimeError(f"step {step}'s train task ended without capturing its weights")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"step {step} waited {deadline_s:.0f}s for the train task to keep its weights "
                f"{lag} optimizer steps before the step's end"
            )
    order.wait_sync_turn(step, deadline_s)
    synced = sync(run, step, trainer_client(ctx))
    order.synced(step)
    version = step - capture.behind / ctx.config.train.optim_steps_per_step()
    host.set_version(version)  # the producer admits the next step's groups now
    trained = future.result(timeout=deadline_s)
    trained.update(capture_s=capture.capture_s, synced_version=version)
    return trained, synced
