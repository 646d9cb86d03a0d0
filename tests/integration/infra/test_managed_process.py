"""A service process pinned to cores (``ManagedProcess(cpus=...)``, the plan's inference.cpus and
trainer.cpus) runs there, and so does everything it starts."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

from rollflow.infra.processes import ManagedProcess

# The service prints its cores, then those of a process it starts (as vLLM starts its engine
# core, torchrun its ranks).
PROBE = (
    "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); "
    "subprocess.run([sys.executable, '-c', "
    "'import os; print(sorted(os.sched_getaffinity(0)), flush=True)'])"
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_a_pinned_service_and_its_children_run_on_its_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    log = tmp_path / "probe.log"
    proc = ManagedProcess("probe", [sys.executable, "-c", PROBE], log, cpus=(core,))
    proc.start()
    deadline = time.monotonic() + 60
    while proc.is_alive():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    assert proc.returncode == 0, log.read_text()
    assert log.read_text().split() == [f"[{core}]", f"[{core}]"]


# The service listens as vLLM does (SO_REUSEPORT) and forks a child that keeps the socket and
# ignores SIGTERM (as vLLM's forked engine core, busy in a step, does for a while).
FORKS = """
import os, signal, socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_service_whose_guard_was_killed_is_stopped_whole_and_lets_its_port_go(tmp_path):
    """A SIGKILLed guard leaves its group behind (it cannot trap that signal): stop() found no
    descendants of the dead guard and returned at once, and a restarted vLLM server then shared
    its port with the old engine core still listening on it."""
    import signal
    import socket

    import psutil

    from rollflow.infra.processes import free_port

    port = free_port()
    log = tmp_path / "svc.log"
    proc = ManagedProcess("svc", [sys.executable, "-c", FORKS, str(port)], log)
    proc.start()
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text():
        assert time.monotonic() < deadline and proc.is_alive(), log.read_text()
        time.sleep(0.05)
    guard, *service = proc.pids()
    assert len(service) == 2, service
    os.kill(guard, signal.SIGKILL)
    while proc.is_alive():
        time.sleep(0.05)
    try:
        proc.stop(timeout_s=1)
        left = [
            p for p in service if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
        assert left == [], f"still running after stop(): {left}"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # nothing listens there any more
    finally:
        for pid in service:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# A service slow to leave on SIGTERM (as torchrun is while its ranks linger after a peer died).
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)
# The flow run's process: starts the service, stops it, and is SIGKILLed by its worker while it
# waits (Prefect's process worker kills a cancelled flow run 30 s after its SIGTERM).
OWNER = """
import sys, time
from rollflow.infra.processes import ManagedProcess
proc = ManagedProcess("stubborn", [sys.executable, "-c", sys.argv[2]], sys.argv[1])
proc.start()
while "ready" not in open(sys.argv[1]).read():
    time.sleep(0.05)
print(*proc.pids(), flush=True)
proc.stop(timeout_s=120)
"""


def test_a_service_whose_owner_is_killed_while_stopping_it_is_killed_with_it(tmp_path):
    """The owner's stop() sends SIGTERM to the whole group, guard included. The guard outlives
    it: killed while it waits, the owner still takes the service with it (the guard's parent-death
    signal), and nothing is left holding the trainer's ports (a torchrun left so held node 0's
    rendezvous port when a cancelled trainer node was placed again)."""
    import subprocess

    import psutil

    log = tmp_path / "stubborn.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(log), STUBBORN], stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2, pids  # the guard and the service
        time.sleep(1.0)  # the owner's SIGTERM has reached the group
        assert psutil.pid_exists(pids[1])  # the service ignores it
        owner.kill()
        owner.wait(timeout=10)
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids[1:]], timeout=15)
        assert not alive, f"the service outlived its owner: {alive}"
    finally:
        owner.kill()
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


# A launcher as torchrun is: it starts its rank in a session of its own and ends on SIGTERM; the
# rank does not (hung in a collective on a GPU; held at a fault point in the chaos tests).
LAUNCHER = """
import signal, subprocess, sys
rank = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", rank], start_new_session=True)
print("ready", child.pid, flush=True)
signal.sigwait({signal.SIGTERM})
"""


def test_a_rank_in_a_session_of_its_own_dies_with_its_owner(tmp_path):
    """The guard's kill reaches every descendant, not only its group: a rank that outlived its
    trainer node's flow run, re-parented away, held node 0's rendezvous port against the
    restarted trainer (the two-host run's lost node 0)."""
    import subprocess

    import psutil

    log = tmp_path / "launcher.log"
    keeps = OWNER.replace("proc.stop(timeout_s=120)", "time.sleep(120)")  # a flow run at work
    owner = subprocess.Popen(
        [sys.executable, "-c", keeps, str(log), LAUNCHER], stdout=subprocess.PIPE, text=True
    )
    rank = None
    try:
        owner.stdout.readline()  # the service is ready
        rank = psutil.Process(int(log.read_text().split()[1]))
        assert os.getsid(rank.pid) == rank.pid  # out of the guard's group
        owner.kill()
        owner.wait(timeout=10)
        gone, alive = psutil.wait_procs([rank], timeout=20)
        assert not alive, f"the rank outlived its owner: {alive}"
    finally:
        owner.kill()
        if rank is not None:
            with contextlib.suppress(psutil.Error):
                rank.kill()
