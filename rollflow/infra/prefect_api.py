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
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

from rollflow.infra.errors import ServiceError
from rollflow.infra.service import ManagedProcess, free_port

START_SERVER_HINT = (
    "start one with `prefect server start` (in another terminal), then "
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
        response = httpx.get(f"{url.rstrip('/')}/health", headers=headers, timeout=timeout_s)
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
def local_prefect_api(timeout_s: float = 60.0) -> Iterator[str | None]:
    """Use the configured Prefect API, or run a private one for the duration of the block."""
    settings = get_current_settings()
    if settings.api.url:
        yield settings.api.url
        return
    port = free_port()
    home = Path(settings.home).expanduser()
    server = ManagedProcess(
        "prefect API",
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(Path(__file__).resolve().parents[2]),
            "--factory",
            "rollflow.infra.prefect_server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        home / "rollflow-api.log",
        env={
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **{
                f"PREFECT_SERVER_SERVICES_{name.upper()}_ENABLED": "false"
                for name in PRIVATE_API_SERVICES_OFF
            },
            **settings.to_environment_variables(exclude_unset=True),
        },
    )
    url = f"http://127.0.0.1:{port}/api"
    server.start()
    try:
        server.wait_healthy(
            lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, timeout_s
        )
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_prefect_workers(timeout_s=10)
    finally:
        server.stop(timeout_s=10)


def _drain_prefect_workers(timeout_s: float) -> None:
    """Send Prefect's queued logs and events while the API still runs. Left for the exit, they
    met a stopped API and its client retried for ~70 s (measured after a failed run)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)
