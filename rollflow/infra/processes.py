"""Lifecycle of the long-lived service processes (trainer, inference, the private Prefect API).

Invariant: a ``ManagedProcess`` that was started is, after ``stop()`` returns, gone together
with every process of its group; and if the thread that started it dies first (a killed run),
the whole group is terminated too, so a run never leaves a service behind.

How: the service runs under a small bash guard that leads its own process group. The kernel
sends the guard SIGUSR1 when its parent thread dies (``PR_SET_PDEATHSIG``), and the guard then
terminates the group, and kills it 5 s later. A parent-death signal on the service alone is not
enough: vLLM's EngineCore and workers, children of its API server, survived it (measured).
The signal is per *thread*: start services from a thread that lives as long as they should.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

from rollflow.infra.errors import ServiceError

_PR_SET_PDEATHSIG = 1
# The guard: a bash between the owner and the service, the leader of the service's process
# group. When its owner dies (SIGUSR1, its parent-death signal), it stops the whole group and
# every descendant, as they are at that moment: SIGTERM, then SIGKILL 5 s later. Descendants
# by name too, not only the group: torchrun starts each rank in a session of its own, and a rank
# that does not end on SIGTERM (hung in a collective; held at a fault point) outlived the group's
# kill, re-parented away, holding node 0's rendezvous port against the restarted trainer. (The
# kernel lists a process's children in /proc/PID/task/TID/children.) A SIGTERM to the group
# (``stop``) does not end the guard: it waits on for the service, so an owner killed while it
# stops the service (Prefect's worker kills a cancelled flow run 30 s after its SIGTERM) still
# takes a slow service with it. (A guard that died of that SIGTERM left torchrun holding a trainer
# node's rendezvous port.) ``:`` and not ``""``: an ignored signal would stay ignored in the
# service. The group comes last in the SIGKILL: the guard leads it, and dies with it.
_GUARD = (
    "tree() { local c; for c in $(cat /proc/$1/task/*/children 2>/dev/null); do "
    "echo $c; tree $c; done; }; "
    'trap \'trap "" TERM; all=$(tree $$); kill -TERM -- $all -$$ 2>/dev/null; sleep 5; '
    "kill -KILL -- $all $(tree $$) -$$ 2>/dev/null' USR1; "
    "trap ':' TERM; "
    '"$@" & child=$!; '
    "while :; do wait $child; code=$?; kill -0 $child 2>/dev/null || exit $code; done"
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``, below the kernel's ephemeral range.

    The service binds it later, in another process. A port from ``bind(0)`` comes from the
    ephemeral range, which the kernel also hands out as the source port of every outgoing
    connection: in between, any connection can take it (seen once: a trainer's HTTP port,
    "address already in use", lost while its ranks started). Ports below the range are never
    handed out that way; a random one that binds now is taken. Where the range starts too low
    to leave room, ``bind(0)`` as before.
    """
    low = _ephemeral_low()
    if low >= 11_000:  # room for a thousand ports or more from 10000
        pick = random.SystemRandom()  # not the seeded ``random``: runs and tests seed it alike
        for _ in range(100):
            port = pick.randrange(10_000, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_port_free(
    host: str, port: int, timeout_s: float, who: str, on_held: Callable[[], None] | None = None
) -> None:
    """Return once nothing listens on ``host:port``; after ``timeout_s``, raise ``ServiceError``
    naming the processes that do. ``on_held`` is called once, when the port is first found held
    (to say what is waited for).

    vLLM binds its port with ``SO_REUSEPORT``: started on a port that another process still
    listens on (the server's previous engine core, still exiting; another run's server), it
    binds anyway, and the kernel splits new connections between the two sockets: some requests
    then wait on a process that never answers them (seen once: a restarted server's weight group
    set-up hung for its whole timeout). A bind without that option fails instead.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR: a closed connection's TIME_WAIT does not hold the port, a listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError:
                pass
        if on_held is not None:
            on_held()
            on_held = None
        if time.monotonic() >= deadline:
            raise ServiceError(
                f"{who}: port {port} on {host} is still taken after {timeout_s:.0f}s, by "
                f"{_listeners(port)}; stop that process or choose another port"
            )
        time.sleep(0.1)


def _listeners(port: int) -> str:
    """Who listens on ``port``, as 'pid N (command)' (what this user may see of it)."""
    holders = []
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections("tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                with contextlib.suppress(psutil.Error):
                    name = " ".join(psutil.Process(conn.pid).cmdline()[:3]) if conn.pid else "?"
                    holders.append(f"pid {conn.pid} ({name})")
    return ", ".join(sorted(set(holders))) or "a process this user cannot see"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def cpu_split() -> tuple[list[int], list[int]]:
    """How a host without a GPU shares its cores between vLLM and the trainer: (vLLM's, the trainer's).

    vLLM's CPU worker binds its OpenMP threads to its cores and busy-polls between requests; a
    trainer whose threads also ran there was ~7× slower (2 cores, tiny step: 1.13 s → 0.17 s once
    its one thread kept off vLLM's core; docs/performance.md). vLLM gets the first half of the
    cores this process may use (at least one), the trainer the rest; one core is shared.
    """
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    if len(cpus) == 1:
        return cpus, cpus
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def log_tail(path: str | Path, num_lines: int = 40) -> str:
    """The last ``num_lines`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=num_lines))
    except FileNotFoundError:
        return ""


def _guard_dies_with_parent() -> None:
    # Runs in the child between fork and exec.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)


class ManagedProcess:
    """A subprocess in its own process group, with a log file, a health wait and a bounded stop.

    ``niceness`` lowers the scheduling priority of the service and everything it starts (added
    to this process's own): on a host whose cores the services share, work that is off the
    critical path yields the cores to the work that is on it. ``cpus`` pins the service and
    everything it starts to those cores (the plan's ``inference.cpus`` / ``trainer.cpus``).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: str | Path,
        env: dict[str, str] | None = None,
        niceness: int = 0,
        cpus: tuple[int, ...] = (),
    ):
        self.name, self.argv, self.log_path = name, list(argv), Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.niceness = niceness
        self.cpus = tuple(cpus)
        self.proc: subprocess.Popen | None = None

    def _in_child(self) -> None:
        # Runs in the child between fork and exec.
        _guard_dies_with_parent()
        if self.niceness:
            with contextlib.suppress(OSError):
                os.nice(self.niceness)
        if self.cpus:  # checked by the plan: cores this process may use
            os.sched_setaffinity(0, self.cpus)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", _GUARD, f"rollflow-{self.name.replace(' ', '-')}-guard", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=self._in_child,
            )

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The service's exit code once it exited (128 + N when killed by signal N)."""
        return self.proc.poll() if self.proc is not None else None

    def error(self, message: str) -> ServiceError:
        return ServiceError(
            f"{self.name}: {message}; log: {self.log_path}\n"
            f"--- last lines of the log ---\n{log_tail(self.log_path)}"
        )

    def wait_healthy(
        self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.25
    ) -> float:
        """Poll ``probe`` until true; fail at once if the process exits, or at the deadline."""
        start = time.monotonic()
        while True:
            if not self.is_alive():
                code = self.proc.returncode if self.proc else None
                raise self.error(f"exited with code {code} before becoming healthy")
            with contextlib.suppress(Exception):
                if probe():
                    return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise self.error(f"not healthy after {timeout_s:.0f}s")
            time.sleep(interval_s)

    def pids(self) -> list[int]:
        """The guard, the service and every descendant still alive."""
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def members(self) -> list[psutil.Process]:
        """Every process of the service still running: the guard's descendants, and every process
        still in its group. The second matters once the guard is gone (killed, say): its
        descendants are then re-parented away from it, and only their group still names them."""
        if self.proc is None:
            return []
        found = {}
        for pid in self.pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                found[pid] = psutil.Process(pid)
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if proc.pid not in found and os.getpgid(proc.pid) == self.proc.pid:
                    found[proc.pid] = proc
        return list(found.values())

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after ``timeout_s``; returns once no
        process of the service runs (a dead guard included: its group may outlive it)."""
        if self.proc is None:
            return
        procs = self.members()
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        alive = _wait_gone(procs, timeout_s)
        if alive or self.proc.poll() is None:
            _signal_group(pgid, signal.SIGKILL)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            _wait_gone(alive, 5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process has exited; those still running after ``timeout_s``. A zombie
    counts as gone: it holds no port or memory, and one re-parented to a PID 1 that does not
    reap would otherwise be waited for to the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() >= deadline:
            return alive
        # Reaps those that are our children (the guard); others are reaped by their parent.
        psutil.wait_procs(alive, timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        procs = alive


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
