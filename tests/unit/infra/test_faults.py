"""Fault points (infra/faults.py): an armed point kills or hangs its own process at the passage
or step it names, and nowhere else; a trainer rank passes ``after_checkpoint`` at its first command
after a checkpoint's save, so a fault there lands between two steps, once per run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rollflow.infra import faults
from rollflow.infra.faults import FAULT_ENV

COUNTED = """
from rollflow.infra.faults import fault_point
for passage in range(1, 6):
    print(passage, flush=True)
    fault_point("checkpoint_upload")
print("passed", flush=True)
"""

# A rank other than 0 takes its commands from rank 0's broadcast: here, a scripted list.
RANK = """
from rollflow.trainer import rank_main
commands = [
    {"op": "forward_backward", "args": {"step": 1}},
    {"op": "save_checkpoint", "args": {"step": 1}},
    {"op": "forward_backward", "args": {"step": 2}},
    {"op": "save_checkpoint", "args": {"step": 2}},
    {"op": "forward_backward", "args": {"step": 3}},
    {"op": "shutdown", "args": {}},
]
class Control:
    def broadcast(self, obj=None):
        return commands.pop(0)
class Ops:
    rank, control = 1, Control()
    def run(self, op, args):
        print(op, args["step"], flush=True)
rank_main.serve(Ops(), None)
print("shut down", flush=True)
"""


def start(code: str, armed: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if armed is not None:
        env[FAULT_ENV] = armed
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, text=True
    )


def test_a_counted_point_kills_its_process_at_the_nth_passage():
    proc = start(COUNTED, "checkpoint_upload@3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert out.split() == ["1", "2", "3"]


def test_an_unarmed_or_otherwise_armed_point_does_nothing():
    for armed in (None, "weight_broadcast@1"):
        proc = start(COUNTED, armed)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split()[-1] == "passed", (armed, out)


def test_a_rank_hangs_at_its_first_command_after_the_named_steps_checkpoint():
    proc = start(RANK, "after_checkpoint@2:stop")
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            assert proc.poll() is None and time.monotonic() < deadline, "the rank did not hang"
            time.sleep(0.05)
    finally:
        proc.kill()
    out, _ = proc.communicate(timeout=60)
    # Step 2's save ran; step 3's first command did not.
    assert out.splitlines() == [
        "forward_backward 1",
        "save_checkpoint 1",
        "forward_backward 2",
        "save_checkpoint 2",
    ]


def test_a_rank_that_never_saves_the_named_step_runs_on():
    """A trainer restarted from step 2's checkpoint saves step 3 onward: the fault does not strike
    it again."""
    proc = start(RANK, "after_checkpoint@4:stop")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.splitlines()[-1] == "shut down", out


@pytest.mark.parametrize(
    "value", ["nowhere@1", "checkpoint_upload@x", "checkpoint_upload@2:pause", "@2"]
)
def test_a_misspelt_fault_is_refused_naming_the_variable_and_the_points(value):
    with pytest.raises(ValueError, match=rf"{FAULT_ENV}=.*after_checkpoint.*checkpoint_upload"):
        faults.parse(value)


def test_a_fault_reads_as_its_point_step_and_signal():
    assert faults.parse("") is None
    assert faults.parse("weight_broadcast") == ("weight_broadcast", 1, signal.SIGKILL)
    assert faults.parse("after_checkpoint@2:stop") == ("after_checkpoint", 2, signal.SIGSTOP)
