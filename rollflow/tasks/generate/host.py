"""The rollout producer's home for one run: its own event-loop thread in the run-flow process.

Step flows run in several threads at once (they overlap); the producer is not thread-safe, so it
lives on one loop and every call from a task crosses into that loop. The host also keeps the
steps' two orders, however the flows overlap: step N trains only after step N-1 released the
trainer (its weights are out), and commits only after step N-1 committed.

The end of training is the trainer's to say: a watcher on the host's loop long-polls the
trainer service's ``/training_finished``; when the trainer publishes it (after the run's last
optimizer step) the producer is finished at once: it stops admitting and cancels what is in flight.

Invariant: ``close()`` (after the ``training_finished`` event, or on a failure) ends every
waiter: pending ``take`` calls raise ``TrainingFinished``, ``wait_released`` and
``wait_committed`` raise, the loop stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from rollflow.infra.config import RunConfig
from rollflow.infra.http import Endpoint, ServiceCallError, acall, async_client
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.inference.gate import serving_gate
from rollflow.tasks.generate.environments import Environment, RolloutContext
from rollflow.tasks.generate.producer import FinishedGroup, RolloutProducer, prompt_stream
from rollflow.tasks.generate.rollouts import SamplingStats, group_runner

log = logging.getLogger(__name__)
_HOSTS: dict[str, ProducerHost] = {}

# Step flows in flight beyond the staleness bound's S + 2: a flow run's own start and finish
# (~1 s on 2 cores: API calls, and the heartbeat thread it joins at the end) then happen while
# earlier steps train, also when a step takes less than that (a tiny step: ~0.3 s).
EXTRA_STEP_FLOWS = 2


def step_flows_in_flight(cfg: RunConfig) -> int:
    """How many step flows run at once: the ones within the staleness bound, and a margin."""
    return cfg.train.max_staleness + 2 + EXTRA_STEP_FLOWS


def host_for(run: str) -> ProducerHost:
    """The live producer host of ``run`` in this process."""
    try:
        return _HOSTS[run]
    except KeyError:
        raise RuntimeError(f"no rollout producer is running for run {run!r} in this process; "
                           "step flows run inside the rl-run flow, which starts it") from None


MakeContext = Callable[[InferenceClient, SamplingStats], RolloutContext]


class ProducerHost:
    """Runs a ``RolloutProducer`` on a private loop thread; its methods are thread-safe.

    ``reused_steps`` are the steps after the checkpoint whose committed rollouts are trained on
    again (see ``reusable_rollouts``); the producer's first group goes to the step after them.
    """

    def __init__(self, cfg: RunConfig, envs: dict[str, Environment], make_ctx: MakeContext,
                 inference_url: str, trainer: Endpoint, resumed_from: int, reused_steps: list[int] = ()):
        self.cfg, self.envs = cfg, envs
        self.reused_steps = frozenset(reused_steps)
        first_step = resumed_from + 1 + len(self.reused_steps)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-producer", daemon=True)
        self.thread.start()
        self._taken = self._released = self._committed = resumed_from
        self._released_at = self._last_step_end = time.perf_counter()
        self._closed: BaseException | None = None
        self._cond = threading.Condition()
        self.sampling_stats = SamplingStats()  # retries of aborted or disconnected requests
        self.training_finished = threading.Event()
        self.finished_info: dict = {}

        async def build() -> tuple[InferenceClient, RolloutProducer]:
            client = InferenceClient(inference_url, timeout_s=cfg.inference.request_timeout_s)
            t = cfg.train
            producer = RolloutProducer(
                group_runner(envs, make_ctx(client, self.sampling_stats), cfg.sampling.group_size),
                prompt_stream(envs, {e.name: e.weight for e in cfg.envs}, t.train_batch_size,
                              cfg.run.seed, first_step=first_step),
                train_batch_size=t.train_batch_size, max_staleness=t.max_staleness,
                max_in_flight=t.in_flight_groups(), version=resumed_from, first_step=first_step)
            producer.start()
            self._watcher = asyncio.create_task(self._watch_training_finished(trainer), name="end-watcher")
            return client, producer

        try:
            self.client, self.producer = self._call(build(), timeout_s=60)
        except BaseException:
            self._stop_loop()
            raise
        freeze_heap()
        _HOSTS[cfg.run.name] = self

    def _call(self, coro, timeout_s: float):
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    # ---------------------------------------------------------------- producer

    def take(self, step: int, timeout_s: float) -> tuple[list[FinishedGroup], dict]:
        """``train_batch_size`` finished groups for ``step`` and the producer's numbers.

        Steps take in step order (step N waits for step N-1's take), so the first groups to
        finish go to the earliest step whatever order the overlapping step flows arrive in.
        """
        self._wait(lambda: self._taken >= step - 1, timeout_s,
                   f"step {step} waited for step {step - 1} to take its groups")
        groups = self._call(self.producer.take(step, timeout_s), timeout_s + 5)
        metrics = self._call(_producer_metrics(self.producer, step), 10)
        metrics["retries_total"] = self.sampling_stats.retries
        gate = serving_gate(self.client.base_url)
        metrics["inference_restarts"] = gate.restarts if gate else 0
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

    def set_version(self, version: int) -> None:
        """The inference deployment now serves ``version``: admit the groups it unblocks."""
        self.loop.call_soon_threadsafe(self.producer.set_version, version)

    # ------------------------------------------------------------ end of training

    async def _watch_training_finished(self, trainer: Endpoint) -> None:
        async with async_client() as http:
            while True:
                try:
                    info = await acall(http, trainer, "/training_finished?wait_s=10", method="GET",
                                       timeout_s=20)
                except ServiceCallError as exc:  # the run's health probe fails the run if it is dead
                    log.debug("training_finished poll: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
                if info["finished"]:
                    break
        self.finished_info = info
        snap = self.producer.snapshot()
        await self.producer.finish()  # stop admitting, cancel in-flight groups, end the waiters
        self.finished_info.update(groups_in_flight=snap["num_in_flight"], groups_ready=snap["num_ready"])
        self.training_finished.set()

    def wait_training_finished(self, timeout_s: float) -> dict:
        """The trainer's ``training_finished`` (step, optimizer step, groups still in flight)."""
        if not self.training_finished.wait(timeout_s):
            raise TimeoutError(f"the trainer did not publish training_finished within {timeout_s:.0f}s "
                               f"after step {self.cfg.run.num_steps}; see its log")
        return dict(self.finished_info)

    # --------------------------------------------------------------- step order

    def wait_released(self, step: int, timeout_s: float) -> float:
        """Block until ``step`` released the trainer; returns when it did (``time.perf_counter``)."""
        self._wait(lambda: self._released >= step, timeout_s,
                   f"step {step + 1} waited for step {step} to release the trainer")
        return self._released_at

    def release(self, step: int) -> None:
        """``step`` is done with the trainer and the weights: the next step may train."""
        with self._cond:
            self._released, self._released_at = max(self._released, step), time.perf_counter()
            self._cond.notify_all()

    def wait_committed(self, step: int, timeout_s: float) -> None:
        """Block until ``step`` has committed (steps commit in step order)."""
        self._wait(lambda: self._committed >= step, timeout_s,
                   f"step {step + 1} waited for step {step} to commit")

    def step_seconds(self) -> float:
        """Seconds since the previous step's metrics (or the start): consecutive steps add up to
        the wall clock. Steps call it in step order (each after its predecessor committed)."""
        with self._cond:
            now = time.perf_counter()
            elapsed, self._last_step_end = now - self._last_step_end, now
            return elapsed

    def mark_committed(self, step: int) -> None:
        with self._cond:
            self._committed = max(self._committed, step)
            self._cond.notify_all()

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: done() or self._closed is not None, timeout_s)
            if self._closed is not None:
                raise RuntimeError(f"run closed: {what}") from self._closed
            if not ok:
                raise TimeoutError(f"{what} for {timeout_s:.0f}s")

    # -------------------------------------------------------------------- close

    def close(self, reason: BaseException | None = None, timeout_s: float = 30.0) -> None:
        """Finish the producer, close its client, stop the loop; every waiter ends at once."""
        with self._cond:
            if self._closed is not None:
                return
            self._closed = reason or RuntimeError("training finished")
            self._cond.notify_all()
        _HOSTS.pop(self.cfg.run.name, None)
        try:
            self.loop.call_soon_threadsafe(self._watcher.cancel)
            self._call(self.producer.finish(timeout_s), timeout_s + 5)
            self._call(self.client.aclose(), 10)
        finally:
            self._stop_loop()
            gc.unfreeze()  # frozen objects are never freed, not even at exit (nanobind then warns)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach, until ``gc.unfreeze``.

    A full (generation 2) collection walks every object of the process; with torch,
    transformers and Prefect loaded that is ~0.5M objects and ~0.3 s during which the producer's
    loop stands still (measured: bench/event_loop.py, lag max 1.4 s → 8 ms). What exists when a run
    starts (modules, the model config, services, the producer) lives as long as the run anyway.
    """
    gc.collect()
    gc.freeze()


async def _producer_metrics(producer: RolloutProducer, step: int) -> dict:
    snap = producer.snapshot()
    return {**producer.step_metrics(step), "groups_in_flight": snap["num_in_flight"],
            "producer_blocked_s": snap["blocked_by_bound_s"], "loop_lag_p50_s": snap["loop_lag_p50_s"],
            "loop_lag_p99_s": snap["loop_lag_p99_s"], "loop_lag_max_s": snap["loop_lag_max_s"]}
