"""What a run shows on the terminal, and what goes to its log instead.

Owns: the split between the terminal (progress lines, warnings, and an error as one line) and
the run's log file ``<log dir>/run.log`` (everything: rollflow's and Prefect's records at INFO
and above, every traceback). With ``--debug`` the terminal gets the tracebacks too.

Invariant: a run that fails or is stopped prints at most one ``error:`` or ``stopped`` line
(plus where its traceback is); a stop says which steps are committed and the command that
resumes the run.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path

from rollflow.infra.config import RunConfig

RUN_LOG = "run.log"


def quiet_prefect_console(debug: bool) -> None:
    """Before Prefect is imported: its console handler shows nothing unless ``debug`` (its
    records, tracebacks of failed step flows included, still go to the API and to run.log)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if debug else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
    if not debug:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")


class _NoTraceback(logging.Formatter):
    """One line per record: the message, never the traceback (that is in run.log)."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        return text.splitlines()[0] if text else text


def attach_run_log(log_dir: Path, debug: bool) -> Path:
    """Send every record to ``log_dir/run.log``; rollflow's warnings to the terminal (one line)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / RUN_LOG
    file = logging.FileHandler(path, encoding="utf-8")
    file.setLevel(logging.INFO)
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(file)
    for name in ("rollflow", "prefect"):
        if logging.getLogger(name).getEffectiveLevel() > logging.INFO:
            logging.getLogger(name).setLevel(logging.INFO)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)
    if not debug:
        terminal.setFormatter(_NoTraceback())
    logging.getLogger("rollflow").addHandler(terminal)
    return path


def log_failure(exc: BaseException, log_path: Path | None) -> None:
    """The traceback of ``exc`` into the run's log (appended)."""
    if log_path is None:
        return
    try:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write("run failed:\n")
            log.write("".join(traceback.format_exception(exc)))
    except OSError:
        pass


def one_line(exc: BaseException) -> str:
    """The first line of the message of ``exc`` (its class name when it has none)."""
    from rollflow.infra.errors import RollflowError

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, RollflowError) and first:
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def stop_on_sigterm() -> None:
    """SIGTERM stops the run as Ctrl-C does: the main thread unwinds, services are stopped."""

    def handler(signum, frame):
        raise Stopped("SIGTERM")

    signal.signal(signal.SIGTERM, handler)


def resume_command(config: str, overrides: list[str]) -> str:
    return shlex.join(["rollflow", "run", config, *overrides])


def stopped_line(exc: KeyboardInterrupt, cfg: RunConfig, config: str, overrides: list[str]) -> str:
    """``stopped by Ctrl-C: committed through step 7 of 40 in runs/x; resume with: rollflow run ...``."""
    from rollflow.infra.storage import RunStorage

    how = "SIGTERM" if isinstance(exc, Stopped) else "Ctrl-C"
    try:
        storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
        steps = storage.committed_steps("checkpoints")
        where = storage.uri
    except Exception:  # storage unreadable: still say how to resume
        steps, where = None, cfg.run.storage
    if steps is None:
        done = "committed steps unknown"
    elif not steps:
        done = f"no step committed yet in {where}"
    else:
        done = f"committed through step {steps[-1]} of {cfg.run.num_steps} in {where}"
    return f"stopped by {how}: {done}; resume with: {resume_command(config, overrides)}"
