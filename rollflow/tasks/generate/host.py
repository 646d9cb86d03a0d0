"""The rollout producer's home for one run: its own event-loop thread in the run-flow process.

Step flows run in several threads at once (they overlap); the producer is not thread-safe, so it
lives on one loop and every call from a task crosses into that loop. The end of training is the
trainer's to say: the run flow calls ``finish()`` when the trainer publishes it, and the producer
stops admitting and cancels what is in flight.

Invariant: ``finish()`` or ``close()`` (after the end of training, or on a failure) ends every
waiter: pending and later ``take`` calls raise ``TrainingFinished`` (or the producer's failure).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import TrainingFinished
from rollflow.infra.metric_names import Metric
from rollflow.infra.vllm_fleet.fleet import Fleet
from rollflow.infra.vllm_fleet.pool import InferencePool
from rollflow.tasks.generate.environments import Environment, RolloutContext
from rollflow.tasks.generate.producer import FinishedGroup, RolloutProducer, prompt_stream
from rollflow.tasks.generate.quarantine import EnvQuarantine
from rollflow.tasks.generate.rollouts import SamplingStats, group_has_signal, group_runner

# Step flows in flight beyond the staleness bound's S + 2: a flow run's own start and finish
# (~1 s on 2 cores: API calls, and the heartbeat thread it joins at the end) then happen while
# earlier steps train, also when a step takes less than that (a tiny step: ~0.3 s).
EXTRA_STEP_FLOWS = 2


def step_flows_in_flight(cfg: RunConfig) -> int:
    """How many step flows run at once: the ones within the staleness bound, and a margin."""
    return cfg.train.whole_staleness() + 2 + EXTRA_STEP_FLOWS


MakeContext = Callable[[InferencePool, SamplingStats], RolloutContext]
# The run's advantage estimator: one group's rewards in, one advantage per sample out. The flow
# hands it over (the advantage stage owns it; no stage imports another).
Advantages = Callable[[list[float]], list[float]]


def inference_pool(cfg: RunConfig, servers: Fleet | list[str]) -> InferencePool:
    """The producer's client of the run's servers (its fleet, as it changes): room for every
    group in flight on one server (a single-turn group is one request; the client's default of
    256 connections held the rest of 1024 groups back in the client,
    bench/producer_throughput.py)."""
    return InferencePool.following(
        servers if isinstance(servers, Fleet) else Fleet(servers),
        timeout_s=cfg.inference.request_timeout_s,
        max_connections=max(256, cfg.train.in_flight_groups()),
    )


class ProducerHost:
    """Runs a ``RolloutProducer`` on a private loop thread; its methods are thread-safe.

    Owns: the producer's loop and the order in which steps take their groups. ``reused_steps``
    are the steps after the checkpoint whose committed rollouts are trained on again (see
    ``reusable_rollouts``); the producer's first group goes to the step after them.
    With dynamic sampling (``train.resamples()``, on by default with the filter), a finished
    group is judged by ``advantages`` (the run's estimator, given by the flow): one whose
    advantages are all zero is sampled anew.
    """

    def __init__(
        self,
        cfg: RunConfig,
        envs: dict[str, Environment],
        make_ctx: MakeContext,
        inference: Fleet | list[str],
        resumed_from: int,
        reused_steps: list[int] = (),
        advantages: Advantages | None = None,
    ):
        if cfg.train.resamples() and advantages is None:
            raise ValueError(
                "dynamic sampling (train.dynamic_sampling, on by default with the zero-advantage "
                "filter) needs the run's advantage estimator: pass "
                "advantages=advantage_fn(cfg.train), or set train.dynamic_sampling = false"
            )
        self.cfg, self.envs = cfg, envs
        self.reused_steps = frozenset(reused_steps)
        first_step = resumed_from + 1 + len(self.reused_steps)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="rollout-producer", daemon=True
        )
        self.thread.start()
        self._taken = resumed_from
        self._closed: BaseException | None = None
        self._cond = threading.Condition()
        self.sampling_stats = SamplingStats()  # retries of aborted or disconnected requests

        async def build() -> tuple[InferencePool, RolloutProducer]:
            client = inference_pool(cfg, inference)
            t = cfg.train
            rollout_ctx = make_ctx(client, self.sampling_stats)
            producer = RolloutProducer(
                group_runner(envs, rollout_ctx, cfg.sampling.group_size),
                prompt_stream(
                    envs,
                    {e.name: e.weight for e in cfg.envs},
                    t.train_batch_size,
                    cfg.run.seed,
                    first_step=first_step,
                ),
                train_batch_size=t.train_batch_size,
                max_staleness=t.staleness_bound(),
                max_in_flight=t.in_flight_groups(),
                version=resumed_from,
                first_step=first_step,
                has_signal=group_has_signal(advantages) if t.resamples() else None,
                max_resampled=t.resample_budget(),
                over_request_steps=t.over_request_steps,
                over_request_quantile=t.over_request_quantile,
                quarantine=EnvQuarantine(
                    after=cfg.sampling.env_quarantine_after,
                    probe_every_s=cfg.sampling.env_probe_every_s,
                    clock=time.monotonic,
                    envs=frozenset(envs),
                    give_up_s=cfg.sampling.env_quarantine_give_up_s,
                ),
            )
            # Multi-turn episodes record the version each turn was requested at.
            rollout_ctx.policy_version = lambda: producer.version
            producer.start()
            return client, producer

        try:
            self.client, self.producer = self._call(build(), timeout_s=60)
        except BaseException:
            self._stop_loop()
            raise
        freeze_heap()

    def _call(self, coro, timeout_s: float):
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def take(self, step: int, timeout_s: float) -> tuple[list[FinishedGroup], dict]:
        """``train_batch_size`` finished groups for ``step`` and the producer's numbers.

        Steps take in step order (step N waits for step N-1's take), so the first groups to
        finish go to the earliest step whatever order the overlapping step flows arrive in.
        """
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._taken >= step - 1 or self._closed is not None, timeout_s
            )
            if self._closed is not None:
                raise TrainingFinished(
                    f"the producer is closed: step {step} gets no groups"
                ) from self._closed
            if not ok:
                raise TimeoutError(
                    f"step {step} waited for step {step - 1} to take its groups for {timeout_s:.0f}s"
                )
        groups = self._call(self.producer.take(step, timeout_s), timeout_s + 5)
        metrics = self._call(_producer_metrics(self.producer, step), 10)
        metrics[Metric.RETRIES_TOTAL] = self.sampling_stats.retries
        metrics[Metric.INFERENCE_RESTARTS] = sum(self.client.restarts().values())
        metrics.update(self.client.metrics())
        self._advance_taken(step)
        return groups, metrics

    def reuses(self, step: int) -> bool:
        """Whether ``step`` trains on its committed rollouts; if so, the next step may take."""
        if step in self.reused_steps:
            self._advance_taken(step)
            return True
        return False

    def _advance_taken(self, step: int) -> None:
        with self._cond:
            self._taken = max(self._taken, step)
            self._cond.notify_all()

    def set_version(self, version: float) -> None:
        """The inference deployment now serves ``version``: admit the groups it unblocks."""
        self.loop.call_soon_threadsafe(self.producer.set_version, version)

    def finish(self, timeout_s: float = 30.0) -> dict:
        """The end of training: stop admitting, cancel what is in flight, end the waiters.
        Returns the groups that were still in flight and ready when it came."""

        async def finish() -> dict:
            snap = self.producer.snapshot()
            await self.producer.finish(timeout_s)
            return {"groups_in_flight": snap["num_in_flight"], "groups_ready": snap["num_ready"]}

        return self._call(finish(), timeout_s + 5)

    def close(self, reason: BaseException | None = None, timeout_s: float = 30.0) -> None:
        """Finish the producer, close its client, stop the loop; every waiter ends at once."""
        with self._cond:
            if self._closed is not None:
                return
            self._closed = reason or TrainingFinished("training finished")
            self._cond.notify_all()
        try:
            self._call(self.producer.finish(timeout_s), timeout_s + 5)
            self._call(self.client.aclose(), 10)
        finally:
            self._stop_loop()
            unfreeze_heap()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# Generation-1 collections between two full ones (CPython's default: 10).
FULL_COLLECTION_EVERY = 100
_THRESHOLDS = list(gc.get_threshold())  # the process's own, restored by unfreeze_heap


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach, until ``gc.unfreeze``,
    and make full collections of what comes after rarer.

    A full (generation 2) collection walks every object of the process; with torch,
    transformers and Prefect loaded that is ~0.5M objects and ~0.3 s during which the producer's
    loop stands still (measured: bench/event_loop.py, lag max 1.4 s → 8 ms). What exists when a run
    starts (modules, the model config, services, the producer) lives as long as the run anyway.
    Afterwards the objects of the groups in flight (tasks, requests, connections: ~100k at 1024
    single-request groups) still made each full collection a 20-60 ms stall, two or three every
    15 s; at a tenth of that rate they leave the loop's p99 lag. Cycles are still collected,
    later.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = _THRESHOLDS[:] = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


def unfreeze_heap() -> None:
    """Undo ``freeze_heap``: frozen objects are never freed, not even at exit (nanobind then warns)."""
    gc.unfreeze()
    gc.set_threshold(*_THRESHOLDS)


async def _producer_metrics(producer: RolloutProducer, step: int) -> dict:
    snap = producer.snapshot()
    return {
        **producer.step_metrics(step),
        Metric.GROUPS_IN_FLIGHT: snap["num_in_flight"],
        Metric.PRODUCER_BLOCKED_S: snap["blocked_by_bound_s"],
        **{
            k: snap[k]
            for k in (Metric.LOOP_LAG_P50_S, Metric.LOOP_LAG_P99_S, Metric.LOOP_LAG_MAX_S)
        },
    }
