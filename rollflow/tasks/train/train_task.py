"""The train stage: the algorithm's loop over epochs and mini-batches, on the trainer service.

Mini-batches and epochs live here, never in the ranks: the step's groups are split into
``train_batch_size / mini_batch_size`` mini-batches, and each is one ``forward_backward`` (the
service splits it over ranks and micro-batches) and one ``optim_step``. With
``train.old_logprobs = "trainer"`` a ``forward`` pass first records the trainer's own log-probs
of the whole batch, before any optimizer step of this outer step, as the ratio's denominator
(and TIS then reweights by trainer / sampler).

With a fractional ``max_staleness`` the task keeps the weights ``sync_lag`` optimizer steps
before the step's end (``MidStepCapture``) and says so; the step flow sends that copy to vLLM
while the remaining optimizer steps train.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.config import TrainSection
from rollflow.infra.context import RunContext
from rollflow.infra.metric_names import Metric
from rollflow.infra.moments import PerEnvMoments
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer.protocol import ForwardBackwardReply, OptimStepReply, SavedReply


class MidStepCapture:
    """The weights kept for vLLM ``lag`` optimizer steps before the step's end, and the signal.

    The train task captures them (``weights_capture``, tagged with the step) after its
    ``n - lag`` th optimizer step (n: the step's optimizer steps; at once when n <= lag) and sets
    ``done``; ``behind`` is then how many optimizer steps they lack, ``min(lag, n)``.
    """

    def __init__(self, lag: int):
        self.lag = lag
        self.behind: int | None = None
        self.capture_s = 0.0
        self.done = threading.Event()

    def take(self, trainer: TrainerClient, step: int, behind: int) -> None:
        self.capture_s = trainer.weights_capture(step).capture_s
        self.behind = behind
        self.done.set()


def trainer_client(ctx: RunContext) -> TrainerClient:
    """The run's trainer service, with the config's deadline on every compute call."""
    return TrainerClient(ctx.trainer, ctx.config.trainer.request_timeout_s)


def minibatches(group_indices: list[int], train: TrainSection) -> list[list[int]]:
    """The step's groups in ``train_batch_size / mini_batch_size`` near-equal slices, in order
    (fewer when filters left fewer groups than slices); each is one optimizer step."""
    count = train.train_batch_size // train.mini_batch_size
    return [
        part.tolist()
        for part in np.array_split(np.array(group_indices, dtype=int), count)
        if len(part)
    ]


def sample_minibatches(
    sample_keys: list[tuple[int, int]], train: TrainSection, seed: int
) -> list[list[tuple[int, int]]]:
    """The step's (group, sample) keys in a random order drawn from ``seed``, in
    ``train_batch_size / mini_batch_size`` near-equal slices (fewer when fewer samples than
    slices): every sample in exactly one slice, each slice one optimizer step."""
    count = train.train_batch_size // train.mini_batch_size
    order = np.random.default_rng(seed).permutation(len(sample_keys))
    return [
        sorted(sample_keys[i] for i in part) for part in np.array_split(order, count) if len(part)
    ]


def step_denominator(
    num_loss_tokens: int | None, num_parts: int, train: TrainSection
) -> float | None:
    """The denominator of every optimizer step's token mean under ``train.token_mean = "batch"``:
    the step's loss tokens (those of the groups the zero-advantage filter left out included) over
    its mini-batches per epoch (TRL's ``loss_type="dapo"``: the generation batch's tokens over its
    optimizer steps). None under ``"mini_batch"``: the trainer service divides by each
    mini-batch's own loss tokens. A step without loss tokens (every row all environment tokens)
    has a zero loss whatever it is divided by: by 1."""
    if train.token_mean == "mini_batch" or num_parts == 0:
        return None
    if num_loss_tokens is None:
        raise ValueError("train.token_mean = 'batch' needs the step's loss tokens, none given")
    return max(num_loss_tokens, 1) / num_parts


# Averaged over a step's optimizer steps (each already a global token mean): the fields of
# forward_backward's reply, then of optim_step's.
FB_MEANS = (
    "loss",
    "clip_fraction",
    "entropy",
    "mismatch_kl",
    "ess",
    "kl",
    "tis_weight",
    "is_masked_fraction",
    "is_ratio_q05",
    "is_ratio_q50",
    "is_ratio_q95",
)
OPTIM_MEANS = ("grad_norm", "lr")

OptimizerStep = tuple[ForwardBackwardReply, OptimStepReply]


def summarize_optimizer_steps(steps: list[OptimizerStep]) -> dict[str, float]:
    """One outer step's metrics from its optimizer steps' replies: a flat dict of floats.

    Scalars are averaged over optimizer steps; tokens/s is total tokens over total trainer time
    (forward_backward + optim_step); per-environment moments are merged, then summarised.
    """
    if not steps:
        return {"num_optim_steps": 0, "num_loss_tokens": 0}
    out = {k: sum(getattr(fb, k) for fb, _ in steps) / len(steps) for k in FB_MEANS}
    out.update({k: sum(getattr(o, k) for _, o in steps) / len(steps) for k in OPTIM_MEANS})
    busy_s = sum(fb.forward_backward_s + o.optim_step_s for fb, o in steps)
    out["num_optim_steps"] = len(steps)
    out["num_loss_tokens"] = sum(fb.num_loss_tokens for fb, _ in steps)
    out["num_tokens"] = sum(fb.num_tokens for fb, _ in steps)
    out["tokens_per_s"] = out["num_tokens"] / busy_s if busy_s > 0 else math.nan
    per_env = PerEnvMoments()
    for fb, _ in steps:
        per_env.merge_json(fb.per_env)
    out.update(per_env.flat())
    return out


def split_seed(run_seed: int, step: int) -> int:
    """The seed of step ``step``'s sample split: a resumed step trains the same mini-batches."""
    return run_seed * 1_000_003 + step


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(
    ctx: RunContext,
    step: int,
    group_indices: list[int],
    sample_keys: list[tuple[int, int]] = (),
    capture: MidStepCapture | None = None,
    num_loss_tokens: int | None = None,
) -> dict[str, float]:
    """For each epoch, for each mini-batch of the step's batch: forward_backward then optim_step.

    Mini-batches are slices of the step's ``sample_keys`` in a seeded random order
    (``train.mini_batch_split = "samples"``, the default), or whole groups (``"groups"``). With
    ``capture``, the weights are kept for vLLM ``capture.lag`` optimizer steps before the end.
    ``num_loss_tokens``: the batch's loss tokens, the token mean's denominator under
    ``train.token_mean = "batch"``."""
    t = ctx.config.train
    trainer = trainer_client(ctx)
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if t.mini_batch_split == "samples":
        seed = split_seed(ctx.config.run.seed, step)
        parts = [
            {"groups": sorted({g for g, _ in keys}), "samples": keys}
            for keys in sample_minibatches(list(sample_keys), t, seed)
        ]
    else:
        parts = [{"groups": groups, "samples": None} for groups in minibatches(group_indices, t)]
    if t.old_logprobs == "trainer" and parts:
        metrics["forward_s"] = trainer.forward(step, sorted(group_indices)).forward_s
    denominator = step_denominator(num_loss_tokens, len(parts), t)
    results: list[OptimizerStep] = []
    total = t.num_epochs * len(parts)
    capture_at = max(0, total - capture.lag) if capture is not None else None
    for _ in range(t.num_epochs):
        for part in parts:
            if len(results) == capture_at:
                capture.take(trainer, step, total - capture_at)
            fb = trainer.forward_backward(
                step,
                part["groups"],
                samples=part["samples"],
                loss=t.loss,
                old_logprobs=t.old_logprobs,
                num_loss_tokens=denominator,
            )
            results.append((fb, trainer.optim_step()))
    if capture_at is not None and len(results) == capture_at:  # no optimizer step this step
        capture.take(trainer, step, 0)
    metrics.update(summarize_optimizer_steps(results))
    # The trainer publishes training_finished after the run's last step (even one with no data).
    trainer.end_step(step)
    metrics["train_s"] = time.perf_counter() - start
    return metrics


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint(ctx: RunContext, step: int) -> SavedReply:
    """Save model, optimizer, schedule, RNG and step to ``checkpoints/step=N``: the step's commit
    point. Then, with run.keep_checkpoints, remove older checkpoints (only now that this one's
    ``_SUCCESS`` exists), never the one the trainer resumed from, nor (run.keep_best_checkpoint)
    the best by held-out reward among those evaluated."""
    saved = trainer_client(ctx).save_checkpoint(step)
    run = ctx.config.run
    if run.keep_checkpoints is not None:
        protect = (ctx.resumed_from,)
        if run.keep_best_checkpoint:
            protect += best_evaluated(ctx.storage)
        ctx.storage.keep_last("checkpoints", run.keep_checkpoints, protect=protect)
    return saved


def best_evaluated(storage) -> tuple[int, ...]:
    """The committed checkpoint whose step's held-out reward is the best so far (the first of
    equals), or none where no checkpointed step was evaluated. Reads the metrics of the kept
    checkpoints' steps only (a few files, however long the run)."""
    evaluated = []
    for step in storage.committed_steps("checkpoints"):
        reward = (storage.read_step_metrics(step) or {}).get(Metric.EVAL_REWARD)
        if isinstance(reward, int | float) and math.isfinite(reward):
            evaluated.append((reward, -step))
    return (-max(evaluated)[1],) if evaluated else ()
