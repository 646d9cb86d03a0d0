"""The rollout producer: groups generated ahead of training, admitted under the staleness bound.

One long-lived asyncio component keeps up to K groups in flight and hands each step's generate
task ``train_batch_size`` finished groups, first finished first out. It knows nothing of HTTP:
it calls a ``run_group(prompt, version_started)`` coroutine (see ``group_runner``) and counts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from statistics import fmean

from rollflow.infra import staleness
from rollflow.infra.errors import ProducerFailed, TrainingFinished
from rollflow.infra.metric_names import Metric, per_env
from rollflow.tasks.generate.environments import Environment, Prompt
from rollflow.tasks.generate.quarantine import EnvQuarantine, disabled
from rollflow.tasks.generate.rollouts import (
    GroupResult,
    RunGroup,
    select_prompts,
    train_prompt_seed,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedGroup:
    """One finished group; ``index`` is its admission order (0-based, since the start)."""

    index: int
    prompt: Prompt
    result: GroupResult
    version_started: float
    version_finished: float  # the version current when the group finished
    started_s: float
    finished_s: float

    @property
    def error(self) -> str | None:
        return self.result if isinstance(self.result, str) else None


def groups_to_over_request(needed: int, p_flat: float, quantile: float, cap: int) -> int:
    """The least e ≤ ``cap`` for which ``needed + e`` groups hold ``needed`` with signal with
    probability ``quantile``, each group without signal with probability ``p_flat``: the
    quantile of a negative binomial count (groups without signal met before ``needed`` with).
    The mean count ``needed·p/(1-p)`` falls short in about half the steps, and a step short of
    it replaces serially (a round trip each)."""
    if p_flat <= 0:
        return 0
    log_flat, log_signal = math.log(p_flat), math.log1p(-p_flat)
    reached = 0.0
    for e in range(cap + 1):
        # P(exactly e without signal before the needed-th with): C(needed-1+e, e) (1-p)^needed p^e
        reached += math.exp(
            math.lgamma(needed + e)
            - math.lgamma(needed)
            - math.lgamma(e + 1)
            + needed * log_signal
            + e * log_flat
        )
        if reached >= quantile:
            return e
    return cap


class RolloutProducer:
    """Generates groups ahead of training, never further ahead than ``max_staleness`` steps.

    Invariants (B = ``train_batch_size``, S = ``max_staleness``, v = the policy version vLLM holds,
    F = ``first_step``, the step the first admitted group goes to; F = v + 1 on a fresh start):

    - admission (the rule of ``infra/staleness.py``): a group is admitted only if afterwards
      ``admitted ≤ ⌊S + v + 2 - F⌋ · B + max(dropped, over_requested)`` (dropped: groups given
      back below, stale or without signal; over_requested: see dynamic sampling), so without
      drops group ``index`` i, which step F + i // B trains on, started from a version
      ``≥ F + i // B - 1 - S``. S = 0 is synchronous on-policy RL. A resumed run whose next steps
      reuse committed rollouts starts with F past them, so those steps count against the bound.
      Versions and S may be fractions of a step: ``v = N - a/n`` are step N's weights ``a`` of
      its ``n`` optimizer steps before its end (sent mid-step), and S = 1/4 with n = 4 admits
      step N + 1's groups once those of N - 1/4 are served.
    - accounting, at every await point (the issue's ``submitted == accepted + filtered +
      running``): ``admitted == emitted + (stale_dropped + resampled + cancelled) + (in_flight + ready)``,
      where ``cancelled`` only grows in ``finish()`` or a fatal failure. A group whose run
      returned an error string is emitted like any other (and counted in ``failed``); it is never
      retried or dropped here, so a failing group cannot starve a step under the bound.
    - every admitted group is emitted at most once, to exactly one step, first finished first
      out; steps waiting at once are served lowest step first; ``take(step)`` again returns the
      same groups (a retried generate task loses nothing).
    - staleness ``(step - 1) - version_started`` of every emitted group is ``≤ S``. Admission
      alone cannot promise it: a group overtaken by faster ones is emitted at a later step. Such
      a group, too old for the step being served, is dropped, counted in ``stale_dropped`` and
      logged, and its admission slot is given back, so a replacement starts from the current
      version. When a step takes its groups, those left ready or in flight that no later step may
      take (at S = 0: all of them) are dropped at once (in flight: cancelled), counted in
      ``stale_dropped`` too. Without over-request S = 0 admits one step at a time, so nothing is
      ever dropped there.
    - dynamic sampling (DAPO), when ``has_signal`` is given: a finished group without signal
      (its advantages all zero, e.g. every sample right or every one wrong) is dropped before any
      step takes it and its admission slot is given back, as for a stale group, so a replacement
      starts from the current version and the staleness bound holds. At most ``max_resampled``
      groups per step taken so far (plus one step's worth) are dropped; past that a group is
      kept (the advantage stage filters it as before). Drops are counted in ``resampled``.
      Over-request (``over_request_steps`` > 0): so that replacements run alongside the batch, not
      in serial rounds after it, each step's first wave admits e groups more (at most
      ``max_resampled``; p the share without signal of the groups judged over the last
      ``over_request_steps`` steps): the least e for which B + e groups hold B with signal with
      probability ``over_request_quantile`` (``groups_to_over_request``; 0.5 is about the mean
      count ``B·p/(1-p)``), and up to that many in flight beyond K. Drops consume that
      credit before they open slots (``max(dropped, over_requested)`` above), so a replacement
      starts after the group it replaces only when the over-request fell short. Surplus groups
      with signal stay ready for the next step, within the staleness bound.
    - quarantine (``quarantine.py``): after a run of failed groups of one environment its
      prompts are set aside at admission (not admitted, so nothing above changes) except a probe
      every interval; every environment quarantined for long enough stops the producer with
      ``ProducerFailed``.
    - the end is explicit: only ``finish()`` stops the producer; every waiting or later ``take``
      then raises ``TrainingFinished``. A raise from ``run_group`` stops it with ``ProducerFailed``.
    """

    def __init__(
        self,
        run_group: RunGroup,
        prompts: Iterator[Prompt] | Callable[[], Prompt],
        *,
        train_batch_size: int,
        max_staleness: float,
        max_in_flight: int,
        version: float = 0,
        first_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        lag_interval_s: float = 0.1,
        has_signal: Callable[[GroupResult], bool] | None = None,
        max_resampled: int = 0,
        over_request_steps: int = 0,
        over_request_quantile: float = 0.9,
        quarantine: EnvQuarantine | None = None,
    ):
        # K within [B, B * (whole steps of S + 1)] is the config's check (RunConfig), not repeated here.
        B, S, K = train_batch_size, max_staleness, max_in_flight
        self.train_batch_size, self.max_staleness, self.max_in_flight = B, S, K
        self._run_group = run_group
        self._next_prompt = prompts.__next__ if isinstance(prompts, Iterator) else prompts
        self._clock, self._lag_interval_s = clock, lag_interval_s
        self.version = version
        # Group i goes to step first_step + i // B, which trains on version first_step + i // B - 1.
        self.first_step = version + 1 if first_step is None else first_step
        self._ready: deque[FinishedGroup] = deque()
        # (step, n): the first n ready groups are within the bound for that step (already checked).
        self._checked: tuple[int, int] = (-1, 0)
        self._tasks: dict[asyncio.Task, float] = {}  # in flight: the version each started from
        self._superseded: set[asyncio.Task] = set()  # cancelled as too old for any later step
        self._service_tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()
        self._pending_steps: set[int] = set()
        self._taken: dict[int, list[FinishedGroup]] = {}
        self._step_metrics: dict[int, dict] = {}
        self._lags_s: deque[float] = deque(maxlen=3000)  # the last ~5 min at 10 Hz
        self.num_admitted = self.num_emitted = self.num_failed = self.num_cancelled = 0
        self.num_stale_dropped = 0
        self._has_signal, self.max_resampled = has_signal, max_resampled
        self.num_resampled = 0  # groups without signal dropped and sampled anew (dynamic sampling)
        self._resampled_at_take = 0
        # Over-request: credit granted so far (cumulative, compared with the drops), and the
        # (judged, without signal) counts of the last steps' groups that the credit is learned from.
        self.num_over_requested = self._over_requested_at_take = self._credit_granted = 0
        self._judged: deque[tuple[int, int]] = deque(maxlen=max(1, over_request_steps))
        self._judging = [0, 0]
        self._over_request_steps = over_request_steps
        self._over_request_quantile = over_request_quantile
        self._opened_through = self.first_step - 1  # the newest step whose first wave was granted
        self._blocked_s, self._blocked_since = 0.0, None
        self._exhausted = False
        self._stopped: BaseException | None = None  # TrainingFinished or ProducerFailed
        self.quarantine = quarantine or disabled(clock)
        self._set_aside_in_a_row = 0
        self._open_steps()

    def start(self) -> None:
        """Start admitting (call from the event loop that will run the producer)."""
        self._service_tasks = [
            asyncio.create_task(self._admit_loop(), name="producer-admit"),
            asyncio.create_task(self._sample_lag(), name="producer-lag"),
        ]

    async def __aenter__(self) -> RolloutProducer:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.finish()

    def set_version(self, version: float) -> None:
        """Record a weight sync: the inference engine now holds policy ``version``."""
        if staleness.version_went_back(version, self.version):
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version
        self._open_steps()
        self._notify()

    async def finish(self, timeout_s: float = 30.0) -> None:
        """The ``training_finished`` event: stop admitting, cancel in-flight groups, end waiters."""
        self._stop(TrainingFinished("training finished: the producer emits no more groups"))
        tasks = [*self._tasks, *self._service_tasks]
        pending = (await asyncio.wait(tasks, timeout=timeout_s))[1] if tasks else set()
        if pending:
            raise TimeoutError(
                f"{len(pending)} producer tasks still running {timeout_s:g}s after cancellation"
            )

    async def take(self, step: int, timeout_s: float) -> list[FinishedGroup]:
        """The first ``train_batch_size`` groups to finish that no step has taken yet."""
        if step in self._taken:
            return self._taken[step]
        start = self._clock()
        self._pending_steps.add(step)
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    changed = self._changed
                    if self._stopped is not None:
                        raise self._stop_error()
                    if step == min(self._pending_steps):
                        self._drop_stale(step)
                        if len(self._ready) >= self.train_batch_size:
                            break
                    await changed.wait()
        except TimeoutError:
            raise TimeoutError(self._timeout_message(step, timeout_s)) from None
        finally:
            self._pending_steps.discard(step)
        groups = [self._ready.popleft() for _ in range(self.train_batch_size)]
        self._checked = (-1, 0)
        self.num_emitted += len(groups)
        ages = [step - 1 - g.version_started for g in groups]
        self._step_metrics[step] = {
            "version": self.version,
            "wait_s": self._clock() - start,
            Metric.STALE_DROPPED_TOTAL: self.num_stale_dropped,
            Metric.STALENESS_MEAN: fmean(ages),
            Metric.STALENESS_MAX: max(ages),
            "num_failed": sum(g.error is not None for g in groups),
            Metric.RESAMPLED: self.num_resampled - self._resampled_at_take,
            Metric.RESAMPLED_TOTAL: self.num_resampled,
            Metric.OVER_REQUESTED: self.num_over_requested - self._over_requested_at_take,
            Metric.ENVS_QUARANTINED: len(self.quarantine.quarantined()),
            Metric.QUARANTINES_TOTAL: self.quarantine.num_quarantined,
            Metric.QUARANTINE_SET_ASIDE_TOTAL: self.quarantine.num_set_aside,
            Metric.QUARANTINE_PROBES_TOTAL: self.quarantine.num_probes,
            **{  # 1 while an env's prompts are set aside, per env that finished a group
                per_env(Metric.ENV_QUARANTINED, env): int(env in self.quarantine.next_probe_s)
                for env in self.quarantine.failed_in_a_row
            },
        }
        self._resampled_at_take = self.num_resampled
        self._over_requested_at_take = self.num_over_requested
        self._judged.append((self._judging[0], self._judging[1]))
        self._judging = [0, 0]
        self._drop_left_over(step)
        self._taken[step] = groups
        for old in [s for s in self._taken if s < step - self.max_staleness - 2]:
            del self._taken[old]  # only a retry of a recent step can ask again
        self._notify()
        return groups

    def _drop_stale(self, step: int) -> None:
        """Drop the ready groups too old for ``step``. The take calls it on every finished group:
        only the groups that arrived since its last call for the same step are checked (a full
        rescan made a step of B groups cost O(B²) checks)."""

        def ok(g: FinishedGroup) -> bool:
            return staleness.allowed(g.version_started, step, self.max_staleness)

        checked_step, checked = self._checked
        start = checked if checked_step == step else 0
        stale = [g for g in itertools.islice(self._ready, start, None) if not ok(g)]
        if stale:
            self._ready = deque(g for g in self._ready if ok(g))
        self._checked = (step, len(self._ready))
        if not stale:
            return
        self.num_stale_dropped += len(stale)
        log.warning(
            "step %d: dropped %d finished groups started from versions %s, older than the "
            "staleness bound allows (>= %d); their admission slots are reused",
            step,
            len(stale),
            sorted({g.version_started for g in stale}),
            round(staleness.oldest_allowed_version(step, self.max_staleness), 4),
        )
        self._notify()  # the freed slots let admission go on

    def _drop_left_over(self, step: int) -> None:
        """After ``take(step)``: drop the ready groups no later step may take and cancel those
        in flight (over-requested groups left over at S = 0, or overtaken ones), so their slots
        open now and no core keeps sampling them."""

        def ok(version: float) -> bool:
            return staleness.allowed(version, step + 1, self.max_staleness)

        num_ready = len(self._ready)
        self._ready = deque(g for g in self._ready if ok(g.version_started))
        self.num_stale_dropped += num_ready - len(self._ready)
        old = [t for t, v in self._tasks.items() if not ok(v) and t not in self._superseded]
        for task in old:
            self._superseded.add(task)
            task.cancel()  # counted in stale_dropped by _count_cancelled once it has ended
        if num_ready > len(self._ready) or old:
            log.debug(
                "step %d: %d ready and %d in-flight groups left over, too old for step %d: dropped",
                step,
                num_ready - len(self._ready),
                len(old),
                step + 1,
            )

    def _open_steps(self) -> None:
        """Grant each newly open step's over-request: drops up to it start no new group."""
        newest = staleness.newest_step(self.version, self.max_staleness)
        for _ in range(self._opened_through + 1, newest + 1):
            extra = self._over_request()
            self._credit_granted = max(self._credit_granted, self._num_dropped()) + extra
            self.num_over_requested += extra
        self._opened_through = max(self._opened_through, newest)

    def _over_request(self) -> int:
        """The groups a step's first wave admits beyond B (at most ``max_resampled``), p the share
        without signal of the groups judged over the last ``over_request_steps`` steps: what B
        groups with signal cost at ``over_request_quantile``."""
        judged = sum(n for n, _ in self._judged)
        if not self._over_request_steps or self._has_signal is None or not judged:
            return 0
        p = sum(flat for _, flat in self._judged) / judged
        if p >= 1:
            return self.max_resampled
        return groups_to_over_request(
            self.train_batch_size, p, self._over_request_quantile, self.max_resampled
        )

    def _num_dropped(self) -> int:
        return self.num_stale_dropped + self.num_resampled

    def _credit(self) -> int:
        """Over-requested groups not yet matched by a drop: the in-flight room beyond K."""
        return max(0, self._credit_granted - self._num_dropped())

    def step_metrics(self, step: int) -> dict:
        """Numbers of ``take(step)``: version at take, wait, staleness mean/max, failures."""
        return dict(self._step_metrics[step])

    def snapshot(self) -> dict:
        """Counters and event-loop lag, cheap enough to log every step."""
        lags = sorted(self._lags_s)
        pick = (lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]) if lags else (lambda q: 0.0)
        blocked = self._blocked_s + (
            self._clock() - self._blocked_since if self._blocked_since is not None else 0.0
        )
        last = self._step_metrics[max(self._step_metrics)] if self._step_metrics else {}
        return {
            "version": self.version,
            "num_in_flight": len(self._tasks),
            "num_ready": len(self._ready),
            "num_admitted": self.num_admitted,
            "num_emitted": self.num_emitted,
            "num_failed": self.num_failed,
            "num_cancelled": self.num_cancelled,
            "num_stale_dropped": self.num_stale_dropped,
            "num_resampled": self.num_resampled,
            "num_over_requested": self.num_over_requested,
            "admission_bound": self._bound(),
            "blocked_by_bound_s": blocked,
            Metric.LOOP_LAG_P50_S: pick(0.50),
            Metric.LOOP_LAG_P99_S: pick(0.99),
            Metric.LOOP_LAG_MAX_S: pick(1.0),
            Metric.STALENESS_MEAN: last.get(Metric.STALENESS_MEAN, 0.0),
            Metric.STALENESS_MAX: last.get(Metric.STALENESS_MAX, 0),
        }

    def _bound(self) -> int:
        # Group i goes to step first_step + i // B, which must be <= the newest step a group
        # starting now may go to: admitted <= (newest_step - first_step + 1) · B.
        steps_open = staleness.newest_step(self.version, self.max_staleness) - self.first_step + 1
        # A drop opens a slot once the over-request granted so far is used up.
        return max(0, steps_open) * self.train_batch_size + max(
            self._num_dropped(), self._credit_granted
        )

    async def _admit_loop(self) -> None:
        try:
            while self._stopped is None and not self._exhausted:
                changed = self._changed
                has_room = len(self._tasks) < self.max_in_flight + self._credit()
                if has_room and self.num_admitted < self._bound():
                    self._end_blocked()
                    if self._admit_one():
                        self._set_aside_in_a_row = 0
                    else:  # a quarantined env's prompt: set aside, the next one is drawn
                        self._set_aside_in_a_row += 1
                        if self._set_aside_in_a_row >= 4 * self.train_batch_size:
                            # Only quarantined envs in sight: wait for a probe, do not spin.
                            if (why := self.quarantine.gave_up()) is not None:
                                self._stop(ProducerFailed(why))
                                return
                            await asyncio.sleep(self.quarantine.wait_s())
                            self._set_aside_in_a_row = 0
                    # One admission per loop iteration: a sync that opens a whole step's worth of
                    # slots would otherwise start B groups (tokenise, build and send B requests)
                    # in one iteration and hold the loop for all of them (bench/event_loop.py).
                    await asyncio.sleep(0)
                    continue
                if has_room and self._blocked_since is None:
                    self._blocked_since = self._clock()  # capacity idle only because of the bound
                elif not has_room:
                    self._end_blocked()
                await changed.wait()
        except Exception as exc:  # a broken prompt source must end the waiters, not hang them
            self._stop(_failed(f"admission stopped: {type(exc).__name__}: {exc}", exc))
        finally:
            self._end_blocked()

    def _admit_one(self) -> bool:
        """Start the next prompt's group; False when its env is quarantined (set aside)."""
        try:
            prompt = self._next_prompt()
        except StopIteration:
            self._exhausted = True
            log.warning(
                "prompt source exhausted after %d groups: admitting no more", self.num_admitted
            )
            self._notify()
            return True
        if not self.quarantine.admit(prompt.env):
            return False
        index, version = self.num_admitted, self.version
        self.num_admitted += 1
        task = asyncio.create_task(self._run_one(index, prompt, version), name=f"group-{index}")
        self._tasks[task] = version
        task.add_done_callback(self._cancelled_before_start)
        return True

    def _cancelled_before_start(self, task: asyncio.Task) -> None:
        # A task cancelled before its first step never runs _run_one's bookkeeping.
        if task in self._tasks:
            del self._tasks[task]
            self._count_cancelled(task)

    def _count_cancelled(self, task: asyncio.Task) -> None:
        if task in self._superseded:  # too old for any later step: a stale drop
            self._superseded.discard(task)
            self.num_stale_dropped += 1
            self._notify()  # its slot lets admission go on
        else:
            self.num_cancelled += 1

    async def _run_one(self, index: int, prompt: Prompt, version: float) -> None:
        started_s = self._clock()
        try:
            result = await self._run_group(prompt, version)
        except asyncio.CancelledError:
            self._count_cancelled(asyncio.current_task())
            raise
        except Exception as exc:  # run_group returns recoverable errors; a raise is fatal
            self.num_cancelled += 1
            self._stop(
                _failed(
                    f"run_group raised on group {index} ({prompt.prompt_id}): "
                    f"{type(exc).__name__}: {exc}",
                    exc,
                )
            )
            return
        finally:
            self._tasks.pop(task := asyncio.current_task(), None)
            self._superseded.discard(task)  # a run_group that swallowed the cancel
        self.num_failed += isinstance(result, str)
        self.quarantine.record(prompt.env, result)
        if self._resample(result):
            self._notify()  # the freed slot lets admission go on
            return
        self._ready.append(
            FinishedGroup(index, prompt, result, version, self.version, started_s, self._clock())
        )
        self._notify()

    def _resample(self, result: GroupResult) -> bool:
        """Dynamic sampling: drop a group without signal while the budget allows (see above)."""
        if self._has_signal is None or isinstance(result, str):
            return False
        self._judging[0] += 1
        if self._has_signal(result):
            return False
        self._judging[1] += 1
        budget = (len(self._step_metrics) + 1) * self.max_resampled
        if self.num_resampled >= budget:
            return False
        self.num_resampled += 1
        return True

    def _stop(self, reason: BaseException) -> None:
        if self._stopped is None:
            self._stopped = reason
            for task in [*self._tasks, *self._service_tasks]:
                if task is not asyncio.current_task():
                    task.cancel()
        self._notify()

    def _stop_error(self) -> BaseException:
        # A fresh exception per waiter: one shared instance would pile up their tracebacks.
        assert self._stopped is not None
        err = type(self._stopped)(*self._stopped.args)
        err.__cause__ = self._stopped.__cause__
        return err

    def _notify(self) -> None:
        # Swap in a fresh event: every waiter re-checks, and none can miss a change.
        self._changed.set()
        self._changed = asyncio.Event()

    def _end_blocked(self) -> None:
        if self._blocked_since is not None:
            self._blocked_s += self._clock() - self._blocked_since
            self._blocked_since = None

    async def _sample_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self._lag_interval_s)
            self._lags_s.append(max(0.0, loop.time() - t0 - self._lag_interval_s))

    def _timeout_message(self, step: int, timeout_s: float) -> str:
        why = (
            "blocked by the staleness bound"
            if self.num_admitted >= self._bound()
            else "prompt source exhausted"
            if self._exhausted
            else "waiting for groups to finish"
        )
        ahead = sorted(s for s in self._pending_steps if s < step)
        return (
            f"take(step={step}) timed out after {timeout_s:g}s: {len(self._ready)}/"
            f"{self.train_batch_size} groups ready, {len(self._tasks)} in flight, "
            f"version {self.version:g}, admitted {self.num_admitted} of bound {self._bound()} "
            f"({why})"
            + (f"; steps {ahead} are served first" if ahead else "")
            + self.quarantine.describe()
        )


def _failed(message: str, cause: BaseException) -> ProducerFailed:
    (err := ProducerFailed(message)).__cause__ = cause
    return err


def prompt_stream(
    envs: dict[str, Environment],
    weights: dict[str, float],
    train_batch_size: int,
    seed: int,
    first_step: int = 1,
) -> Iterator[Prompt]:
    """Training prompts in admission order: step N's draw of ``select_prompts`` (same seed as the
    synchronous generate task), then step N+1's, ...; a resumed run starts at its next step."""
    for step in itertools.count(first_step):
        yield from select_prompts(
            envs, weights, train_batch_size, "train", seed=train_prompt_seed(seed, step)
        )
