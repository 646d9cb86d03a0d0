"""The whole job as one Prefect flow: prepare the policy, start the services, loop the steps.

Running the same config again resumes: the run continues after its last committed checkpoint,
never redoing a committed step (see docs/architecture.md, "Resume").
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from functools import partial
from pathlib import Path

from prefect import flow

from rollflow.flows.artifacts import RunProgress, publish_summary
from rollflow.flows.curve import show_curve
from rollflow.flows.live_views import LiveViews
from rollflow.flows.names import FLOW_NAME
from rollflow.flows.order import StepOrder
from rollflow.flows.step_metrics import StepMetrics
from rollflow.flows.train_step import train_step_in_turn
from rollflow.infra.config import RunConfig, dump_config, validate_config
from rollflow.infra.context import RunContext
from rollflow.infra.errors import ConfigError, ServiceError, TrainerLost
from rollflow.infra.events import Event, has_event, publish
from rollflow.infra.metric_names import Metric, by_env, series
from rollflow.infra.metrics_sinks import MetricSinks
from rollflow.infra.outage import (
    Outage,
    OutageStop,
    Watch,
    api_outage,
    patient_prefect_client,
    stop_main,
    storage_outage,
)
from rollflow.infra.prefect_tls import share_tls_context
from rollflow.infra.secrets import load_storage_secret, take_secrets_out
from rollflow.infra.storage import RunStorage
from rollflow.infra.terminal import PrefectRunLog, log_run_failure, say
from rollflow.services.run_services import HEALTH_CHECK_INTERVAL_S, RunServices
from rollflow.tasks.advantage.advantages import advantage_fn
from rollflow.tasks.generate.generate_task import (
    build_envs,
    evaluate,
    make_rollout_context,
    reused_steps,
)
from rollflow.tasks.generate.host import ProducerHost, step_flows_in_flight
from rollflow.tasks.train.client import TrainerClient
from rollflow.tasks.train.warm_start import prepare_tiny_model

# Every process that runs the run flow (`rollflow run`, a deployment's run) gives its Prefect
# clients one TLS context: Prefect builds one per client, ~60 ms of CPU here, and makes one per
# step's subflow. Here, not in rollflow/flows/__init__.py: a run that fails its preflight never
# imports Prefect (1.2 s of `rollflow run`'s fail-fast path).
share_tls_context()

LOCAL_CACHE = Path("~/.cache/rollflow/checkpoints").expanduser()
TRAINING_FINISHED_DEADLINE_S = 30.0


@flow(
    name=FLOW_NAME,
    flow_run_name="{config[run][name]}",
    persist_result=False,
    validate_parameters=False,
)
def rl_run(config: dict) -> dict:
    """Train the policy of ``config`` (a RunConfig as a dict) for ``run.num_steps`` steps."""
    from prefect.context import get_run_context

    with PrefectRunLog(get_run_context().flow_run.id):
        try:
            return _train(config)
        except Exception as exc:
            log_run_failure(exc)
            raise


def _train(config: dict | RunConfig) -> dict:
    cfg = config if isinstance(config, RunConfig) else validate_config(config)
    take_secrets_out(cfg.run)  # a caller that left credentials in: not into config.json
    load_storage_secret(cfg.run)
    storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
    with watched(cfg, storage) as api:
        return _train_watched(cfg, storage, api)


def _train_watched(cfg: RunConfig, storage: RunStorage, api: Outage | None) -> dict:
    """The run, its Prefect API and storage watched (``watched``)."""
    _record_config(storage, cfg)
    resumed_from = _last_checkpoint(storage)
    if resumed_from >= cfg.run.num_steps:
        return _finish_committed_run(cfg, storage)
    base_model = prepare_policy(cfg)
    if resumed_from:
        say(f"run {cfg.run.name}: resuming after committed step {resumed_from}")
    policy_dir = _policy_after(storage, resumed_from, base_model)
    publish(storage, Event.RUN_STARTED, resumed_from=resumed_from)
    progress = RunProgress(cfg.run.name, cfg.run.num_steps, resumed_from)
    live = LiveViews(storage, cfg.run.num_steps, cfg.metrics.ui_every, progress)
    log_dir = storage.log_dir()
    # Sinks open first: a configured sink whose package is missing fails before services start.
    try:
        with (
            MetricSinks.from_config(cfg, log_dir) as sinks,
            RunServices(
                cfg, policy_dir, resumed_from or None, log_dir, progress=say, base_model=base_model
            ) as services,
        ):

            def report(step: int, metrics: dict) -> None:
                say(progress_line(step, cfg.run.num_steps, metrics))
                sinks.log(step, metrics)
                progress.update(step)
                live.committed(step)  # redrawn from storage, every metrics.ui_every steps

            restarts = 0
            while True:
                try:
                    _train_steps(
                        cfg,
                        storage,
                        services,
                        base_model,
                        resumed_from,
                        restarts,
                        sinks,
                        report,
                        api,
                    )
                    break
                except TrainerLost as lost:
                    resumed_from = _restart_trainer(cfg, storage, services, lost, restarts)
                    restarts += 1
    except BaseException:
        live.close(final=False)
        raise
    live.close()  # the last redraw, with every committed step
    publish_summary(storage)
    return summarize(storage, say)


def _finish_committed_run(cfg: RunConfig, storage: RunStorage) -> dict:
    """A run whose steps are all committed trains nothing: its flow run shows the run whole (the
    progress and summary artifacts). A process lost between its last commit and its end had not
    said the end (a rerun by the heal automation can meet this): the rerun records it."""
    say(f"run {cfg.run.name}: all {cfg.run.num_steps} steps are already committed in {storage.uri}")
    if not has_event(storage, Event.TRAINING_FINISHED):
        publish(storage, Event.TRAINING_FINISHED, source="storage", step=cfg.run.num_steps)
    progress = RunProgress(cfg.run.name, cfg.run.num_steps, cfg.run.num_steps)
    LiveViews(storage, cfg.run.num_steps, cfg.metrics.ui_every, progress).close()
    publish_summary(storage)
    return summarize(storage)


def _last_checkpoint(storage: RunStorage) -> int:
    """The last committed step, which a run resumes after (0: none yet)."""
    committed = storage.committed_steps("checkpoints")
    return committed[-1] if committed else 0


def _policy_after(storage: RunStorage, step: int, base_model: Path | str) -> Path | str:
    """What the trainer starts from to go on after ``step``: that checkpoint's local copy, or
    the starting policy before any."""
    return storage.local_copy("checkpoints", step, LOCAL_CACHE) if step else base_model


def _train_steps(
    cfg: RunConfig,
    storage: RunStorage,
    services: RunServices,
    base_model: Path | str,
    resumed_from: int,
    trainer_restarts: int,
    sinks: MetricSinks,
    report: Callable[[int, dict], None],
    api: Outage | None = None,
) -> None:
    """The steps after ``resumed_from`` on the running services, to the trainer's end."""
    ctx = RunContext(
        config=cfg,
        model_path=str(base_model),
        trainer=services.trainer.endpoint,
        inference=services.inference_endpoints,
        trainer_restarts=trainer_restarts,
        resumed_from=resumed_from,
    )
    if resumed_from == 0 and not storage.read_metrics():
        ev = evaluate(ctx)
        start = StepMetrics()
        start.record_eval(ev)
        start_metrics = start.row
        storage.write_metrics(0, start_metrics)
        sinks.log(0, start_metrics)
        say(f"step 0: held-out reward {_fmt_env(ev.reward, ev.reward_by_env)}")
    reused = reused_steps(ctx, resumed_from)
    if reused:
        say(f"reusing the committed rollouts of steps {reused} (within the staleness bound)")
    host = ProducerHost(
        cfg,
        build_envs(cfg, str(base_model)),
        partial(make_rollout_context, cfg, str(base_model), temperature=cfg.sampling.temperature),
        services.fleet,  # followed as it grows and shrinks
        resumed_from,
        reused,
        advantages=advantage_fn(cfg.train),
    )
    end = TrainingEnd(services.trainer, host)
    try:
        with StepOrder(cfg, resumed_from) as order:
            run_steps(ctx, services, host, order, resumed_from, report, api)
        # The end is the trainer's to say; the producer has stopped on it already.
        finished = end.wait(TRAINING_FINISHED_DEADLINE_S)
    except BaseException as exc:
        end.close()
        host.close(exc)
        raise
    publish(storage, Event.TRAINING_FINISHED, source="trainer", **finished)
    host.close()


def _restart_trainer(
    cfg: RunConfig, storage: RunStorage, services: RunServices, lost: TrainerLost, restarts: int
) -> int:
    """Heal a lost trainer: restart it from the last committed checkpoint (vLLM keeps serving);
    returns the step the run resumes after. Raises ``ServiceError`` when the run may not (its
    ``trainer.max_restarts`` used, or other nodes started by hand, which it cannot start)."""
    limit = cfg.trainer.max_restarts
    by_hand = cfg.trainer.num_nodes > 1 and not cfg.trainer.node_deployment
    if restarts >= limit or by_hand:
        why = (
            "a trainer whose other nodes were started by hand is not restarted by the run (with "
            "trainer.node_deployment set, the run submits them again)"
            if by_hand
            else f"not restarted: {restarts} of trainer.max_restarts = {limit} used"
        )
        raise ServiceError(_run_stops(lost, why)) from lost
    detected_at = time.time()
    resumed_from = _last_checkpoint(storage)
    cause, _ = _log_tail_apart(lost)
    say(
        f"trainer lost: {cause}; restarting it from "
        f"{f'committed step {resumed_from}' if resumed_from else 'the starting policy'} "
        f"({restarts + 1}/{limit}); vLLM keeps serving"
    )
    start = time.monotonic()
    policy_dir = _policy_after(storage, resumed_from, services.base_model)
    version = services.restart_trainer(policy_dir, resumed_from or None)
    info = {
        "restart": restarts + 1,
        "reason": cause,
        "detected_at": detected_at,
        "restart_s": time.monotonic() - start,
        "resumed_from": resumed_from,
        "version": version,
    }
    publish(storage, Event.TRAINER_RESTARTED, **info)
    say(
        f"trainer: restarted in {info['restart_s']:.0f}s; resuming after committed step "
        f"{resumed_from}, vLLM serves its policy (version {version})"
    )
    return resumed_from


class TrainingEnd:
    """The explicit end of training, heard from the trainer: a thread long-polls its
    ``training_finished`` and, when it comes (after the run's last optimizer step), finishes the
    producer at once: it stops admitting and cancels what is in flight.

    Invariant: the producer finishes only on the trainer's word, never on a count of groups.
    """

    def __init__(self, trainer: TrainerClient, host: ProducerHost):
        self.trainer, self.host = trainer, host
        self.info: dict = {}
        self._done, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._watch, name="training-end", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                info = self.trainer.training_finished(wait_s=10)
            except ServiceError:  # the run's health check fails the run if the trainer is dead
                self._stop.wait(1.0)
                continue
            if info.finished:
                self.info = {**info.model_dump(), **self.host.finish()}
                self._done.set()
                return

    def wait(self, timeout_s: float) -> dict:
        """The trainer's ``training_finished`` (step, optimizer step, groups still in flight)."""
        if not self._done.wait(timeout_s):
            self.close()
            raise TimeoutError(
                f"the trainer did not publish training_finished within {timeout_s:.0f}s "
                f"after the run's last step; see its log"
            )
        return dict(self.info)

    def close(self) -> None:
        self._stop.set()


def run_steps(
    ctx: RunContext,
    services: RunServices,
    host: ProducerHost,
    order: StepOrder,
    resumed_from: int,
    report: Callable[[int, dict], None],
    api: Outage | None = None,
) -> None:
    """Run the step flows in step order, ``step_flows_in_flight`` at once (each its own flow run).

    While the Prefect API does not answer (``api``: its outage, noticed by the run's watch), no
    new step flow starts: each is a flow run the API must create (docs/performance.md, "Faults").

    The flows beyond the staleness bound wait at their generate task while the others work, so a
    flow run's own cost (~1 s to start and finish) is never on the critical path. A failed step closes the
    producer, which ends the flows waiting on it, and fails the run.
    """
    cfg = ctx.config
    workers = step_flows_in_flight(cfg)
    steps = iter(range(resumed_from + 1, cfg.run.num_steps + 1))
    running: deque[tuple[int, Future]] = deque()
    next_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="step")
    wait_for_pool = True
    try:
        try:
            while True:
                while len(running) < workers and (step := next(steps, None)) is not None:
                    while api is not None and not api.wait_up(HEALTH_CHECK_INTERVAL_S):
                        services.check_alive()
                    run = (
                        contextvars.copy_context().run
                    )  # each thread's flow is a child of this run
                    running.append(
                        (step, pool.submit(run, train_step_in_turn, ctx, step, order, host))
                    )
                if not running:
                    return
                step, future = running.popleft()
                while True:
                    try:
                        metrics = future.result(timeout=max(0.0, next_check - time.monotonic()))
                        break
                    except FuturesTimeout:  # due, whether steps take long or finish quickly
                        services.check_alive()
                        next_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                report(step, metrics)
        except BaseException as exc:
            for _, future in running:
                future.cancel()
            # A step held in a request to a service that is not answering would hold the stop
            # until its client gives up (minutes): the stop does not wait for it.
            wait_for_pool = not isinstance(exc, OutageStop)
            order.close(exc)  # ends the step flows still waiting, before the pool joins them
            host.close(exc)
            if isinstance(exc, Exception) and (dead := services.dead_service(grace_s=5.0)):
                if isinstance(dead, TrainerLost):
                    raise dead from exc  # the run may restart it (_restart_trainer)
                raise ServiceError(_run_stops(dead)) from exc
            raise
    finally:
        pool.shutdown(wait=wait_for_pool, cancel_futures=True)


@contextlib.contextmanager
def watched(cfg: RunConfig, storage: RunStorage) -> Iterator[Outage | None]:
    """While the run runs, its Prefect API and its object store are probed every few seconds: an
    outage of either says one line when noticed and one when over, and past its deadline setting
    stops the run (``OutageStop``, as Ctrl-C does). Yields the API's outage (None: no API)."""
    from prefect.settings import get_current_settings

    from rollflow.infra.prefect_api import api_answers
    from rollflow.infra.storage_access import fail_fast_fs

    with contextlib.ExitStack() as stack:
        api = None
        url = get_current_settings().api.url
        if url:
            api = api_outage(url, cfg.run.api_outage_timeout_s, say, stop_main)
            stack.enter_context(Watch(api, lambda: api_answers(url)))
            stack.enter_context(patient_prefect_client(api))
        if not storage.is_local:
            fs, base = fail_fast_fs(storage.uri, storage.options, read_timeout_s=2)

            def answers() -> bool:
                fs.invalidate_cache()
                try:
                    fs.info(f"{base}/config.json")
                except FileNotFoundError:  # an answer all the same (a new run's first moments)
                    pass
                return True

            outage = storage_outage(storage.uri, cfg.run.storage_outage_timeout_s, say, stop_main)
            stack.enter_context(Watch(outage, answers, name="storage-watch"))
        yield api


def _log_tail_apart(err: ServiceError) -> tuple[str, str]:
    """A service's error, and the log tail it ends with ('; last lines of LOG:\n...'), apart."""
    head, sep, tail = str(err).partition("; last lines of")
    return head, sep + tail


def _run_stops(dead: ServiceError, why: str = "") -> str:
    """The run's last word on a dead service: its error, why the run stops, then the log tail
    (the first line is what the terminal and Prefect show)."""
    head, tail = _log_tail_apart(dead)
    return f"{head}; {why + '; ' if why else ''}the run stops (rerun to resume){tail}"


def prepare_policy(cfg: RunConfig) -> Path | str:
    """The starting policy: the configured HF model, or a tiny model warm-started on the envs."""
    if cfg.model.path is not None:
        return cfg.model.path
    envs = build_envs(cfg)
    rng = random.Random(cfg.run.seed)
    train_pairs, eval_pairs = [], []
    for name in sorted(envs):
        env = envs[name]
        if not hasattr(env, "sft_examples"):
            raise ConfigError(
                f"[model.tiny] needs envs with sft_examples() for its warm start; {name!r} has "
                "none: use model.path, or an env with sft_examples()"
            )
        train_pairs += env.sft_examples(4096, rng)
        eval_pairs += [(p.text, p.answer) for p in env.prompts("eval", 128, rng)]
    recipe = {
        "envs": [e.model_dump() for e in cfg.envs],
        "target": cfg.model.warm_start_target,
        "max_steps": cfg.model.warm_start_max_steps,
        "lr": cfg.model.warm_start_lr,
    }
    return prepare_tiny_model(
        cfg.model.tiny,
        train_pairs=train_pairs,
        eval_pairs=eval_pairs,
        target=cfg.model.warm_start_target,
        max_steps=cfg.model.warm_start_max_steps,
        lr=cfg.model.warm_start_lr,
        cache_dir=cfg.model.cache_dir,
        recipe=recipe,
        progress=say,
    )


# What makes a run the run it is: a rerun that changes one of these is another run.
RUN_DEFINING_KEYS = ("model.path", "model.revision", "model.tiny", "envs")


def _record_config(storage: RunStorage, cfg: RunConfig) -> None:
    """Write config.json once; a rerun with a different config says what changed, and one whose
    model or environments differ from a run with committed steps is refused (never resumed by
    accident) unless ``run.resume_changed`` says to go on."""
    resolved = dump_config(cfg)
    old = storage.read_json("config.json")
    if old is None or not _has_committed_steps(storage):
        storage.write_json("config.json", resolved)
        return
    changed = sorted(_diff(_as_current(old), resolved))
    defining = [k for k in changed if k.startswith(RUN_DEFINING_KEYS)]
    if defining and not cfg.run.resume_changed:
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: {storage.uri} holds a run with another "
            f"{', '.join(defining)}; start a new run with run.name=<new name>, or resume it "
            "with the new values with run.resume_changed=true"
        )
    if changed:
        say(
            f"note: config differs from the run's first config.json in {', '.join(changed)}; "
            "continuing with the new values"
        )


def _has_committed_steps(storage: RunStorage) -> bool:
    return bool(storage.committed_steps("checkpoints") or storage.committed_steps("rollouts"))


def _as_current(old: dict) -> dict:
    """A stored config with today's defaults filled in, so that a key added since is no change."""
    try:
        return dump_config(validate_config(old))
    except ValueError:  # a key that has gone since: compare as stored
        return old


def _diff(a: dict, b: dict, prefix: str = "") -> set[str]:
    out = set()
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.add(prefix + key)
    return out


def _fmt_env(total: float, by_env: dict[str, float]) -> str:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in by_env.items())
    return f"{total:.3f} ({parts})" if len(by_env) > 1 else f"{total:.3f}"


def progress_line(step: int, num_steps: int, m: dict) -> str:
    """One line per step: reward, what was kept (and how many groups without signal dynamic
    sampling replaced, how many it over-requested for that), loss, staleness, and where the time
    went."""
    kept = f"kept {m[Metric.NUM_GROUPS_KEPT]} groups"
    did = [
        f"{int(n)} {what}"
        for key, what in [
            (Metric.RESAMPLED, "resampled"),
            (Metric.OVER_REQUESTED, "over-requested"),
        ]
        if (n := m.get(key, 0)) > 0  # absent (or NaN) where the step reused its rollouts
    ]
    if did:
        kept += f" ({', '.join(did)})"
    line = (
        f"step {step}/{num_steps}: reward {m[Metric.REWARD_MEAN]:.3f}, {kept}, "
        f"loss {m.get(Metric.LOSS, math.nan):+.4f}, "
        f"staleness {m.get(Metric.STALENESS_MEAN, 0.0):.2f} | "
        f"wait {m[Metric.TRAINER_WAIT_FOR_DATA_S]:.2f}s train {m[Metric.TRAIN_PHASE_S]:.2f}s "
        f"sync {m[Metric.SYNC_PHASE_S]:.2f}s | step {m[Metric.STEP_S]:.2f}s"
    )
    if Metric.EVAL_REWARD in m:
        envs = by_env(m, Metric.EVAL_REWARD)
        line += f"\n  held-out reward {_fmt_env(m[Metric.EVAL_REWARD], envs)}"
    return line


def summarize(storage: RunStorage, out=lambda _: None) -> dict:
    """First and last held-out reward of the run, and where its data is; then its curve
    (``flows/curve.py``): the plot's path and, last, the held-out reward as a sparkline."""
    rows = storage.read_metrics()
    evals = series(rows, Metric.EVAL_REWARD)
    summary = {
        "run": storage.run,
        "uri": storage.uri,
        "steps_committed": storage.committed_steps("checkpoints")[-1:],
    }
    if evals:
        summary.update(first_eval_reward=evals[0][1], last_eval_reward=evals[-1][1])
        out(
            f"done: held-out reward {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
            f"(step {evals[-1][0]}); rollouts in {storage.uri}/rollouts"
        )
    summary["curve"] = show_curve(storage, rows, out)
    summary["finished_at"] = time.time()
    return summary
