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
import re
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
    """Send every record to ``log_dir/run.log``; rollflow's warnings to the terminal (one line).

    Prefect applies its logging config when ``prefect.main`` loads (``prefect/__init__.py`` loads
    it at the first ``from prefect import flow``), dropping handlers and levels set before: it is
    loaded here first, so that the run flow's modules, imported later (while the private API
    starts, ``cli._train``), leave this set-up alone."""
    import prefect.main  # noqa: F401

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
    PROGRESS.addHandler(file)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)
    terminal.addFilter(FinalError())
    if not debug:
        terminal.setFormatter(_NoTraceback())
    logging.getLogger("rollflow").addHandler(terminal)
    if not debug:
        internal_to_log(file)
    return path


def internal_to_log(file: logging.Handler) -> None:
    """Prefect's background workers (``EventsWorker``, ``APILogWorker``) log what they failed to
    send, whole ``Event(...)`` reprs of several kilobytes each, on ``prefect._internal``, whose
    handler is the console's stderr: while the API is away that reached the terminal. They go to
    the run's log instead (the terminal has the run's own line about the API). Called once Prefect
    has applied its logging config (``attach_run_log``)."""
    internal = logging.getLogger("prefect._internal")
    for handler in list(internal.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            internal.removeHandler(handler)
    internal.addHandler(file)


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
    # "...; last lines of trainer.log:" introduces a log tail (in run.log): point at the file.
    first = re.sub(r"last lines of (\S+?):?$", r"see \1", first)
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


STOP_READ_DEADLINE_S = 5.0


def uncommitted_note(committed: list[int], ran: list[int], checkpoint_every: int) -> str:
    """`` (steps 9-12 ran but are not committed: ...)``: the steps that wrote their metrics after
    the last committed one, which a resume redoes; "" if none."""
    after = [s for s in ran if s > (committed[-1] if committed else 0)]
    if not after:
        return ""
    one = len(after) == 1
    which = f"step {after[0]} ran but is" if one else f"steps {after[0]}-{after[-1]} ran but are"
    return (
        f" ({which} not committed: a step commits with its checkpoint, "
        f"run.checkpoint_every = {checkpoint_every}; a resume redoes {'it' if one else 'them'})"
    )


def stopped_line(exc: KeyboardInterrupt, cfg: RunConfig, config: str, overrides: list[str]) -> str:
    """``stopped by Ctrl-C: committed through step 7 of 40 in runs/x; resume with: rollflow run ...``;
    a stop for a service's outage (``OutageStop``) names it instead: ``stopped: storage s3://...
    not answering for 600 s (run.storage_outage_timeout_s = 600): ...``."""
    from rollflow.infra.outage import OutageStop, pending_reason
    from rollflow.infra.storage import RunStorage
    from rollflow.infra.storage_access import within_deadline

    reason = exc.reason if isinstance(exc, OutageStop) else pending_reason()
    how = "SIGTERM" if isinstance(exc, Stopped) else "Ctrl-C"
    head = f"stopped: {reason}" if reason else f"stopped by {how}"

    def committed():
        try:
            storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
            return storage.committed_steps("checkpoints"), storage.metric_steps(), storage.uri
        except Exception:  # storage unreadable: still say how to resume
            return None

    # The storage may be what is not answering: never wait on it for long.
    found = within_deadline(committed, STOP_READ_DEADLINE_S, None)
    steps, ran, where = found if found else (None, [], cfg.run.storage)
    if steps is None:
        done = "committed steps unknown"
    elif not steps:
        done = f"no step committed yet in {where}"
    else:
        done = f"committed through step {steps[-1]} of {cfg.run.num_steps} in {where}"
    # Steps that ran after the last checkpoint are redone on resume: say so, or "no step
    # committed" reads as nothing done after a run that printed eight steps.
    if steps is not None:
        done += uncommitted_note(steps, ran, cfg.run.checkpoint_every)
    return f"{head}: {done}; resume with: {resume_command(config, overrides)}"


# ------------------------------------------------------------------ the run's Prefect logs

PROGRESS = logging.getLogger("rollflow.progress")
PROGRESS.setLevel(logging.INFO)
PROGRESS.propagate = False  # its own handlers: the run's Prefect log, run.log (no console dup)


def say(message: str) -> None:
    """A progress line: on the terminal (stdout), in the run's Prefect log and in run.log."""
    print(message, flush=True)
    PROGRESS.info(message)


class _ToFlowRun(logging.Filter):
    """Tags records that carry no flow run (threads, services' watchers) with the run flow's."""

    def __init__(self, flow_run_id) -> None:
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "flow_run_id", None) is None:
            record.flow_run_id = self.flow_run_id
        return True


class FinalError(logging.Filter):
    """Drops the run flow's own record of its failure (the CLI prints that one line itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "rollflow_final", False)


class PrefectRunLog:
    """While the run flow runs, progress lines (INFO) and rollflow's warnings and errors go to
    its flow run's logs on the Prefect API (the UI's Logs tab), from any thread.

    ``print`` never reaches the API, and records from threads without a Prefect run context
    (the producer, the services' watchers) were dropped by Prefect's handler: each is tagged
    with the run flow's id. Prefect's own records (task and flow states) go there as before.
    """

    def __init__(self, flow_run_id) -> None:
        from prefect.logging.handlers import APILogHandler

        self.handler = APILogHandler()
        self.handler.addFilter(_ToFlowRun(flow_run_id))
        self.handler.setFormatter(logging.Formatter("%(message)s"))

    def __enter__(self) -> PrefectRunLog:
        self.handler.setLevel(logging.INFO)
        PROGRESS.addHandler(self.handler)
        warnings = logging.getLogger("rollflow")
        self._warnings_handler = _LevelAtLeast(self.handler, logging.WARNING)
        warnings.addHandler(self._warnings_handler)
        return self

    def __exit__(self, *exc_info) -> None:
        PROGRESS.removeHandler(self.handler)
        logging.getLogger("rollflow").removeHandler(self._warnings_handler)


class _LevelAtLeast(logging.Handler):
    """``target`` for records of ``level`` and above only (the progress logger sends INFO)."""

    def __init__(self, target: logging.Handler, level: int) -> None:
        super().__init__(level)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.filter(record):
            self.target.emit(record)


def log_run_failure(exc: BaseException) -> None:
    """The run flow's failure in its Prefect log: its one line, the traceback below it."""
    logging.getLogger("rollflow.run").error(
        one_line(exc), exc_info=exc, extra={"rollflow_final": True}
    )
