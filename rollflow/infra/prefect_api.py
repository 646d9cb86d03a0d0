"""The Prefect API a run talks to: the configured server, or a private one for the run.

Prefect's own ephemeral server outlives a SIGKILLed parent. ``local_prefect_api`` starts the same
server as a ``ManagedProcess``, so it dies with the run like every other service (its app, with
SQLite writers serialised, is ``prefect_server.create_app``). It keeps what running flows and
tasks need, and none of the services that serve people or deployments (``PRIVATE_API_SERVICES_OFF``):
nobody can open its UI, and it ends with the run.
``require_prefect_server`` is for what needs a real, lasting server (deployments).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_CLIENT_CSRF_SUPPORT_ENABLED,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    get_current_settings,
    temporary_settings,
)

from rollflow.infra import http
from rollflow.infra.errors import ServiceError
from rollflow.infra.prefect_server import server_command
from rollflow.infra.processes import ManagedProcess, free_port

START_SERVER_HINT = (
    "start one with `rollflow ui` (in another terminal), then "
    "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`"
)


# Services of a Prefect server that a private API has no use for: the event feed and automations
# (event_persister, triggers) and the loops for deployments, workers and cancellation. Each step
# is a flow run of ~4 task runs, ~20 events: measured with 4 no-op tasks per flow run on 2 cores,
# the server spent 345 ms of CPU per flow run with them and 290 ms without, on the cores that the
# trainer and vLLM share. The task-run recorder stays: it records the task runs themselves.
PRIVATE_API_SERVICES_OFF = (
    "event_persister",
    "triggers",
    "scheduler",
    "late_runs",
    "pause_expirations",
    "repossessor",
    "foreman",
    "cancellation_cleanup",
    "cleanup_reconciler",
)


# How the private API runs, for its CPU. Measured per step-like flow run (a subflow of 5 no-op
# tasks, a table artifact, 2 events) on 2 cores, with the app of prefect_server.py: the API spent
# ~220 ms of CPU per step before, ~115 ms after.
# - The task-run recorder writes the task runs (15 state events per step) in one batch a second,
#   not ~4 SQL statements per event, each compiled anew: ~-90 ms. The UI shows a task run's state
#   up to 1 s later; a clean stop writes what is queued.
# - Nobody subscribes to its event stream (no UI), so it streams none out.
# - Its websocket (the run's events, ~18 per step) does not compress: both ends paid for that.
# Values the user set (PREFECT_* in the environment or the profile) still win.
PRIVATE_API_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    # whole seconds: Prefect's recorder int()s it, so 0.5 would make it flush in a busy loop
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false",
    # No block types registered at start: Prefect imports every installed collection for it
    # (prefect-docker, prefect-kubernetes: 1.4 s of CPU) and writes ~100 block types and their
    # schemas (those of the collections it knows of) into a new database, for a UI the private
    # API does not serve. A block saved through it registers its own type (``Block.save``). A
    # start on a new database 28-33 s -> 23-24 s, on a used one ~9-10 s -> ~8 s (2 cores).
    "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
    "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",  # its check imports the collections too
}

# The private API runs below the services' priority: what a step waits for (the trainer, vLLM)
# takes the cores first when they are shared. Its work is off the critical path: step flows
# overlap (a flow run's creation and end happen while earlier steps train) and task-run states
# reach it as events.
PRIVATE_API_NICENESS = 10

# The run process's client of the private API: no flow-run heartbeats (nothing reads them: no
# automations, no event persister; and a flow run's end waited up to 1 s for its heartbeat thread,
# ~0.9 s of a no-op step flow's 1.2 s), and no CSRF token fetch (the private API does not check
# CSRF; each new client fetched one).
PRIVATE_API_CLIENT_SETTINGS = {
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
    PREFECT_CLIENT_CSRF_SUPPORT_ENABLED: False,
}


def api_answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at ``url`` answers its ``/health`` with 200 now."""
    return http.client().get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code == 200


def require_prefect_server(timeout_s: float = 5.0) -> str:
    """The configured PREFECT_API_URL once its server answers ``/health``; else a clear error."""
    settings = get_current_settings()
    url = settings.api.url
    if not url:
        raise ServiceError(
            f"PREFECT_API_URL is not set, so there is no Prefect server to register deployments on; "
            f"{START_SERVER_HINT}"
        )
    key = settings.api.key.get_secret_value() if settings.api.key else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = http.client().get(
            f"{url.rstrip('/')}/health", headers=headers, timeout=timeout_s
        )
        problem = (
            None if response.status_code == 200 else f"/health answered HTTP {response.status_code}"
        )
    except httpx.HTTPError as exc:
        problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if problem:
        raise ServiceError(
            f"no Prefect server answers at PREFECT_API_URL={url} ({problem}); {START_SERVER_HINT}, "
            "or set PREFECT_API_URL to the server you use"
        )
    return url


@contextlib.contextmanager
def local_prefect_api(
    timeout_s: float = 120.0, meanwhile: Callable[[], object] | None = None
) -> Iterator[str | None]:
    """Use the configured Prefect API, or run a private one for the duration of the block.

    ``meanwhile`` runs while the private API starts (before the block either way): `rollflow run`
    imports the run flow's modules there, ~7 s of one core here that the server's ~5-10 s of
    start-up on the other core no longer waits for.

    The private API runs niced, so on a host whose cores are all busy it starts last: 60 s was
    exceeded twice at load average 11-16 on 2 cores (2026-11-25). A server that exits fails the
    wait at once, whatever the deadline."""
    settings = get_current_settings()
    if settings.api.url:
        if meanwhile is not None:
            meanwhile()
        yield settings.api.url
        return
    port = free_port()
    home = Path(settings.home).expanduser()
    server = ManagedProcess(
        "prefect API",
        private_api_command(port),
        home / "rollflow-api.log",
        env=private_api_env(settings),
        niceness=PRIVATE_API_NICENESS,
    )
    url = f"http://127.0.0.1:{port}/api"
    server.start()
    try:
        if meanwhile is not None:
            meanwhile()
        server.wait_healthy(
            lambda: http.client().get(f"{url}/health", timeout=2).status_code == 200, timeout_s
        )
        client = {k: v for k, v in PRIVATE_API_CLIENT_SETTINGS.items() if not _user_set(k)}
        with temporary_settings(updates={PREFECT_API_URL: url, **client}):
            try:
                yield url
            finally:
                _drain_prefect_workers(timeout_s=10)
    finally:
        server.stop(timeout_s=10)


def private_api_command(port: int) -> list[str]:
    """The private API's server process: Prefect's app as ``prefect_server.create_app`` makes it."""
    return server_command("127.0.0.1", port)


def private_api_env(settings) -> dict[str, str]:
    """The private API's environment over the run's: its services off, its tuning, and the
    Prefect settings the user set."""
    return {
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **{
            f"PREFECT_SERVER_SERVICES_{name.upper()}_ENABLED": "false"
            for name in PRIVATE_API_SERVICES_OFF
        },
        **PRIVATE_API_ENV,
        **settings.to_environment_variables(exclude_unset=True),
    }


def _user_set(setting) -> bool:
    """Whether the user set this Prefect setting (environment or profile)."""
    return setting.name in get_current_settings().to_environment_variables(exclude_unset=True)


def _drain_prefect_workers(timeout_s: float) -> None:
    """Send Prefect's queued logs and events while the API still runs. Left for the exit, they
    met a stopped API and its client retried for ~70 s (measured after a failed run)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)
