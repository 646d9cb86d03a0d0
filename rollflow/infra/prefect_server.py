"""The app of the Prefect server rollflow starts: the private API of ``rollflow run`` (when none
is configured) and ``rollflow ui``'s server, its UI and services on.

It is Prefect's own server app with these changes:

- On SQLite, every write transaction begins ``IMMEDIATE``. Prefect begins most of them
  ``DEFERRED``; a deferred transaction that reads and then writes while another writer commits
  fails at once with "database is locked" (SQLite's busy timeout does not apply to that upgrade),
  the API answers 503, and the client retries after 2 s, then 4 s, then 8 s. With a step's flow
  runs overlapping, that happened ~30 times in a 40-step tiny run and put 2–8 s stalls on the
  critical path (docs/performance.md). An immediate transaction takes the write lock when it
  begins, so a second writer waits its turn (busy timeout 60 s) instead of failing. Reads are
  unchanged (they begin no transaction).
- The API app answers without gzip (its only client is on the loopback: compressing each
  response cost CPU here and decompressing it cost CPU in the run process) and without the
  ``default_content_type`` HTTP middleware, which only adds the JSON content type for Prefect
  clients older than 3.6.19 (the run's client is the same Prefect as this server) and, as a
  Starlette ``BaseHTTPMiddleware``, costs a task group and two memory streams per request.
- The server's docket worker (cancellation timeouts, log deletion; the perpetual services are
  off) polls its in-memory broker every ``DOCKET_POLL_S`` instead of every 250 ms: the idle API
  spent ~11 ms of CPU per second, ~6.5 with 2 s.

A Prefect server the user runs (``PREFECT_API_URL``) is left as it is: for many concurrent runs
use PostgreSQL there, as Prefect recommends.
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

DOCKET_POLL_S = 2.0


def server_command(host: str, port: int, log_level: str = "error") -> list[str]:
    """The command that serves ``create_app`` on ``host:port``: the private API's and
    ``rollflow ui``'s (prefect_ui.py) server alike. The environment says which parts it runs
    (UI, services): Prefect's ``create_app`` reads ``PREFECT__SERVER_*`` and ``PREFECT_UI_*``."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(Path(__file__).resolve().parents[2]),
        "--factory",
        "rollflow.infra.prefect_server:create_app",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        log_level,
        "--lifespan",
        "on",
        "--ws-per-message-deflate",
        "false",
    ]


def _serialised_sqlite_writers() -> None:
    """Every SQLite write transaction begins IMMEDIATE (module docstring)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    deferred_begin = AioSqliteConfiguration.begin_transaction
    if getattr(deferred_begin, "_rollflow", False):
        return

    @asynccontextmanager
    async def immediate_begin(self, session, with_for_update: bool = False):
        async with deferred_begin(self, session, with_for_update=True) as transaction:
            yield transaction

    immediate_begin._rollflow = True
    AioSqliteConfiguration.begin_transaction = immediate_begin


def _slower_docket_polls() -> None:
    import docket.worker

    worker_init = docket.worker.Worker.__init__
    if getattr(worker_init, "_rollflow", False):
        return

    def init(self, *args, **kwargs):
        kwargs.setdefault("minimum_check_interval", timedelta(seconds=DOCKET_POLL_S))
        kwargs.setdefault("scheduling_resolution", timedelta(seconds=DOCKET_POLL_S))
        worker_init(self, *args, **kwargs)

    init._rollflow = True
    docket.worker.Worker.__init__ = init


def _lighter_api_middleware(app) -> None:
    """Drop gzip and the ``default_content_type`` middleware from the API app (module docstring).
    Starlette builds the stack of middleware at the first request: editing the list now suffices."""
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.middleware.gzip import GZipMiddleware

    api_app = getattr(app, "api_app", None)
    if api_app is None or api_app.middleware_stack is not None:
        return

    def dropped(m) -> bool:
        if m.cls is GZipMiddleware:
            return True
        dispatch = m.kwargs.get("dispatch")
        return (
            m.cls is BaseHTTPMiddleware
            and getattr(dispatch, "__name__", "") == "default_content_type"
        )

    api_app.user_middleware[:] = [m for m in api_app.user_middleware if not dropped(m)]


def create_app():
    """Prefect's API app, its SQLite writers serialised, lighter per request (module docstring)."""
    from prefect.server.api.server import create_app as prefect_create_app

    _serialised_sqlite_writers()
    _slower_docket_polls()
    app = prefect_create_app()
    _lighter_api_middleware(app)
    return app
