"""Lifecycle of the long-lived service processes (trainer, inference).

Invariant: a ``ManagedProcess`` that was started is, after ``stop()`` returns, gone together
with every process of its session; and if our own process dies first, the kernel kills it
(``PR_SET_PDEATHSIG``), so a killed run never leaves a service behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class ServiceError(RuntimeError):
    """A service that did not start, died, or did not answer in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: SIGKILL it when its parent dies.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


class ManagedProcess:
    """A subprocess in its own session with a log file, a health probe and a bounded stop."""

    def __init__(self, name: str, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log_path = name, argv, Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True, preexec_fn=_die_with_parent,
            )

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> float:
        """Poll ``probe`` until true; fail at once if the process exits, or at the deadline."""
        start = time.monotonic()
        while True:
            if not self.is_alive():
                code = self.proc.returncode if self.proc else None
                raise ServiceError(
                    f"{self.name} exited with code {code} before becoming healthy; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if probe():
                    return time.monotonic() - start
            except Exception:
                pass
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise ServiceError(
                    f"{self.name} not healthy after {timeout_s:.0f}s; log {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the whole session, then SIGKILL what is left after ``timeout_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        # Session members that outlived the leader (e.g. spawned workers) get the same end.
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:
            _signal_group(pgid, signal.SIGKILL)
            time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
