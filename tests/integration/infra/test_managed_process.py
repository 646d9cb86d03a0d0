"""A service process pinned to cores (``ManagedProcess(cpus=...)``, the plan's inference.cpus and
trainer.cpus) runs there, and so does everything it starts."""

from __future__ import annotations

import os
import sys
import time

import pytest

from rollflow.infra.service import ManagedProcess

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
