"""``rollflow ui``: a local Prefect server with its UI, for watching runs (the quickstart's too).

    rollflow ui                       # http://127.0.0.1:4200 (or a free port), until Ctrl-C
    PREFECT_API_URL=http://127.0.0.1:4200/api rollflow run configs/quickstart.toml

It is Prefect's own server (UI, API and services), as ``prefect server start`` runs it, but with
the app of infra/prefect_server.py: SQLite writers serialised, so concurrent runs, workers and the
UI's run form do not fail with "database is locked" (the stock server answered a browser's run
form with that toast under one run's writes). It runs as a managed process
(infra/processes.py: its own process group, a log file, a bounded stop), with a persistent
database under ``~/.rollflow/prefect`` (``PREFECT_HOME``; ``--home`` moves it), so runs stay in
the UI from one start to the next. A run given ``PREFECT_API_URL`` reports to it instead of
starting its private API (infra/prefect_api.py), and its artifacts, the live views among them
(flows/live_views.py), show in the UI as it runs.

Invariant: every wait has a deadline: the server answers ``/api/health`` within
``--timeout`` seconds or the command fails with the server's log tail; a stop (Ctrl-C, SIGTERM)
ends every process of the server within ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from rollflow.infra import http
from rollflow.infra.prefect_server import server_command
from rollflow.infra.processes import ManagedProcess, free_port

DEFAULT_HOME = Path("~/.rollflow/prefect")
DEFAULT_PORT = 4200  # Prefect's own; a free one when it is taken
START_TIMEOUT_S = 180.0  # the first start migrates the database: 20-60 s on 2 busy cores
STOP_TIMEOUT_S = 20.0


def pick_port(host: str, port: int | None) -> int:
    """``port`` as given; else Prefect's 4200 when free on ``host``, or a free one."""
    if port:
        return port
    with socket.socket() as s:
        try:
            s.bind((host, DEFAULT_PORT))
            return DEFAULT_PORT
        except OSError:
            return free_port(host)


# Bound to every interface: no address a browser on another machine can use.
WILDCARDS = ("0.0.0.0", "::", "")


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to ``host``: loopback for a wildcard bind."""
    if host in WILDCARDS:
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ui_api_url(host: str, port: int) -> str:
    """The API address the UI's pages call: the server's own; for a wildcard bind ``/api``,
    relative to wherever the browser opened the UI (Prefect would tell the browser
    ``http://0.0.0.0:4200/api``, which no browser on another machine reaches)."""
    return "/api" if host in WILDCARDS else f"{local_url(host, port)}/api"


def server_env(host: str, port: int, ui: bool = True) -> dict[str, str]:
    """The environment of a lasting Prefect server on ``host:port``: services on (schedules,
    late runs, automations, cancellation), its UI when ``ui``. Tests that need a server for
    deployments start the same (tests/deployed_run.py)."""
    return {
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_UI_API_URL": ui_api_url(host, port),
    }


def server_process(home: Path, host: str, port: int) -> ManagedProcess:
    """The server with its UI, its database and log under ``home``."""
    server = ManagedProcess(
        "prefect server",
        server_command(host, port, log_level="warning"),
        home / "server.log",
        env={"PREFECT_HOME": str(home), **server_env(host, port)},
    )
    server.env.pop("PREFECT_API_URL", None)  # the server is the API: never a client of another
    return server


def serve(
    host: str = "127.0.0.1",
    port: int | None = None,
    home: str | Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
    out: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> None:
    """Start the server, wait for ``/api/health``, print the URL and the run line, then hold it
    until ``stop`` is set or Ctrl-C / SIGTERM; the server is stopped in every case. Raises
    ``ServiceError`` (with the server's log tail) when it does not answer within ``timeout_s``."""
    home = Path(home or DEFAULT_HOME).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    port = pick_port(host, port)
    url = local_url(host, port)
    server = server_process(home, host, port)
    stop = stop or threading.Event()
    previous = _stop_on(signal.SIGTERM, stop)
    server.start()
    try:
        out(f"starting prefect server (database and log in {home}) ...")
        server.wait_healthy(
            lambda: http.client().get(f"{url}/api/health", timeout=2).status_code == 200,
            timeout_s,
        )
        out(f"Prefect UI: {url}")
        if host in WILDCARDS:
            out(
                f"  from other machines: http://{socket.gethostname()}:{port} (or this host's address)"
            )
        out("run against it (another terminal):")
        out(f"  PREFECT_API_URL={url}/api rollflow run configs/quickstart.toml")
        out("Ctrl-C stops the server (its runs stay in the database for the next start)")
        while not stop.wait(1.0):
            if not server.is_alive():
                raise server.error(f"exited with code {server.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(timeout_s=STOP_TIMEOUT_S)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    out("prefect server stopped")


def _stop_on(signum: int, stop: threading.Event):
    """Set ``stop`` on ``signum`` (main thread only); the handler it replaces, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signum, lambda *_: stop.set())
