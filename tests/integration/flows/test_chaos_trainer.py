"""Fault tests of a whole run, part 2: its trainer killed.

One run directory goes through every fault in turn, each launch resuming where the last one
stopped (tests/chaos_support.py):

1. the trainer kills itself inside a checkpoint's upload or a weight broadcast (fault points),
   with ``trainer.max_restarts = 0``: the run fails naming it, and nothing half done counts;
2. the trainer is killed at a random point of a step: the run restarts it from its last
   committed checkpoint while vLLM keeps serving, and completes, every step once, with no person
   acting; its progress lines are in its flow runs' logs on the Prefect API.

After every fault no process of the run is left, and storage holds every committed step once.
Part 1, with a run directory of its own: test_chaos_run.py.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.trainer.protocol import RANK_MAIN_MODULE

from chaos_support import (
    START_TIMEOUT_S,
    Campaign,
    flow_run_logs,
    open_campaign,
    service_process,
    service_processes,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

# The two fault-point launches commit at most 2 + 3 steps (their n-th passage, n ≤ 3), so the
# trainer killed at a random point of the next step still leaves steps for the restarted one.
STEPS = 8


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, model_cache) -> Iterator[Campaign]:
    # The session's Prefect API for the launches saves its start-up each time; the trainer-killed
    # launch starts its own, as a run without a configured server does.
    yield from open_campaign(tmp_path_factory, model_cache, "chaos-trainer", steps=STEPS)


@pytest.mark.parametrize("point", ["checkpoint_upload", "weight_broadcast"])
def test_trainer_killed_at_a_fault_point_fails_the_run_then_nothing_half_done_counts(
    campaign, point
):
    """SIGKILL inside a checkpoint's upload (files there, no _SUCCESS) or inside a weight
    broadcast (header sent, weights not): moments too short to hit from outside, so the trainer
    kills itself at a fault point (infra/faults.py), on its seeded n-th passage."""
    c = campaign
    nth = c.rng.randint(1, 3)
    before = c.committed()
    # The fault would strike the restarted trainer too: this test is of the failure's cleanness.
    proc = c.launch(
        "train.max_staleness=0",
        "trainer.max_restarts=0",
        env={"ROLLFLOW_FAULT": f"{point}@{nth}"},
    )
    code = proc.wait(timeout=START_TIMEOUT_S + 120)
    errors = re.findall(r"^error: .*$", c.output(), re.M)
    print(f"fault {point}@{nth}: exit {code}; {errors[-1] if errors else 'no error line'}")
    assert code == 1, c.output()[-3000:]
    assert len(errors) == 1 and "Traceback" not in c.output(), c.output()[-3000:]
    # The traceback is in the run's log, which the line after the error names.
    lines = c.output().splitlines()
    hint = lines[lines.index(errors[0]) + 1]
    log = re.fullmatch(r"  \(traceback in (\S+); --debug prints it here\)", hint)
    assert log and "Traceback" in Path(log[1]).read_text(), hint
    assert re.search(r"trainer.*(died|dead|exited)", errors[0]), errors[0]
    assert "not restarted: 0 of trainer.max_restarts = 0 used" in errors[0], errors[0]
    c.assert_no_orphans()
    c.assert_consistent()
    if point == "checkpoint_upload":  # the upload was cut: its step is not committed
        cut = len(before) + nth
        assert cut not in c.committed(), (cut, c.committed())
        assert (c.run_dir / "checkpoints" / f"step={cut}").exists()  # half there, not counted


def test_a_trainer_killed_at_a_random_point_is_restarted_and_the_run_completes(campaign):
    """trainer.max_restarts (default 2): the run notices the loss, restarts the trainer from the
    last committed checkpoint, forms the weight group anew with the vLLM server that kept
    running (same process), sends it the checkpoint's weights, and goes on: exit 0, every step
    once, the restart an event and a metric, and nobody reran anything."""
    c = campaign
    proc = c.launch("train.max_staleness=1")
    name, reached, delay = c.random_kill_point(len(c.committed()) + 1)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    servers = {p.pid for p in service_processes(c.root, "vllm.entrypoints")}
    victim = service_process(c.root, RANK_MAIN_MODULE)
    # Expect the rank named, also where one rank runs without a launcher (no RANK: rank 0).
    rank = victim.environ().get("RANK", "0")
    before = c.committed()
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)

    def restarted() -> dict | None:
        return next((e for e in c.events(now=True) if e["event"] == "trainer_restarted"), None)

    c.wait_for(proc, lambda: restarted() is not None, "trainer_restarted", timeout_s=240)
    healed_s = time.monotonic() - killed_at
    event = restarted()
    now = {p.pid for p in service_processes(c.root, "vllm.entrypoints")}
    assert now == servers, "vLLM was restarted with the trainer"
    print(
        f"trainer rank {rank} killed {delay}s after {name}: serving again "
        f"{healed_s:.1f}s later (restart {event['restart_s']:.1f}s), from step "
        f"{event['resumed_from']}"
    )
    # From the last checkpoint committed before the kill (or one that committed as it landed).
    assert event["restart"] == 1 and event["resumed_from"] >= (before[-1] if before else 0)
    assert event["resumed_from"] in [0, *c.committed()]
    assert event["version"] == event["resumed_from"]
    assert re.search(r"trainer.*(died|dead|exited)", event["reason"]), event["reason"]
    assert f"trainer rank {rank} " in event["reason"], event["reason"]
    assert proc.wait(timeout=600) == 0, c.output()[-4000:]
    assert "Traceback" not in c.output() and not re.search(r"^error: ", c.output(), re.M)
    assert "trainer lost: " in c.output() and "trainer: restarted in" in c.output()
    c.assert_no_orphans()
    c.assert_consistent(final=True)
    assert c.metrics(STEPS)["trainer_restarts"] == 1
    assert (c.run_dir / "logs" / "trainer.lost-1.log").exists()
    logs = flow_run_logs(c.prefect_api, c.name)
    assert f"step {STEPS}/{STEPS}: reward" in logs, logs[-3000:]
    assert "services: vLLM at" in logs and "trainer: restarted in" in logs
    assert "done: held-out reward" in logs
