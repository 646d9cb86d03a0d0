"""Fault tests of a whole run, part 2: its trainer killed, then a rerun that completes the run.

One run directory goes through every fault in turn, each launch resuming where the last one
stopped (tests/chaos_support.py):

1. the trainer kills itself inside a checkpoint's upload or a weight broadcast (fault points):
   the run fails naming it, and nothing half done counts;
2. the trainer is killed at a random point of a step: the run fails within 60 s naming it; a
   rerun (the printed command) resumes and completes, and its progress lines are in its flow
   runs' logs on the Prefect API.

After every fault no process of the run is left, and storage holds every committed step once.
Part 1, with a run directory of its own: test_chaos_run.py.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import pytest

from rollflow.trainer import SERVICE_MODULE

from chaos_support import (
    START_TIMEOUT_S,
    STEPS,
    Campaign,
    flow_run_logs,
    open_campaign,
    service_process,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, model_cache) -> Iterator[Campaign]:
    # The session's Prefect API for the launches saves its start-up each time; the trainer-killed
    # launch starts its own, as a run without a configured server does.
    yield from open_campaign(tmp_path_factory, model_cache, "chaos-trainer")


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
    proc = c.launch("train.max_staleness=0", env={"ROLLFLOW_FAULT": f"{point}@{nth}"})
    code = proc.wait(timeout=START_TIMEOUT_S + 120)
    errors = re.findall(r"^error: .*$", c.output(), re.M)
    print(f"fault {point}@{nth}: exit {code}; {errors[-1] if errors else 'no error line'}")
    assert code == 1, c.output()[-3000:]
    assert len(errors) == 1 and "Traceback" not in c.output(), c.output()[-3000:]
    assert re.search(r"trainer.*(died|dead|exited)", errors[0]), errors[0]
    c.assert_no_orphans()
    c.assert_consistent()
    if point == "checkpoint_upload":  # the upload was cut: its step is not committed
        cut = len(before) + nth
        assert cut not in c.committed(), (cut, c.committed())
        assert (c.run_dir / "checkpoints" / f"step={cut}").exists()  # half there, not counted


def test_trainer_killed_fails_the_run_fast_naming_it_then_a_rerun_completes(campaign):
    c = campaign
    proc = c.launch("train.max_staleness=0", private_api=True)
    name, reached, delay = c.random_kill_point(len(c.committed()) + 1)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    victim = service_process(c.root, SERVICE_MODULE)
    rank = victim.environ().get("RANK")  # a multi-rank trainer: kill a rank, expect it named
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=120)
    failed_s = time.monotonic() - killed_at
    errors = re.findall(r"^error: .*$", c.output(), re.M)
    assert len(errors) == 1 and "Traceback" not in c.output(), c.output()[-3000:]
    last_error = errors[0]
    print(
        f"trainer{f' rank {rank}' if rank else ''} killed {delay}s after {name}: the run failed "
        f"in {failed_s:.1f}s with: {last_error}"
    )
    assert code != 0 and failed_s < 60
    assert re.search(r"trainer.*(died|dead|exited)", last_error), last_error
    if rank is not None:
        assert f"rank {rank}" in last_error
    c.assert_no_orphans()
    c.assert_consistent()

    # The rerun, as a stopped run prints it: it resumes after the last committed step and
    # finishes; its progress lines are in its flow runs' logs on the Prefect API (the UI's Logs).
    before = c.committed()
    proc = c.launch("train.max_staleness=1")
    assert proc.wait(timeout=600) == 0, c.output()[-4000:]
    if before:
        assert f"resuming after committed step {before[-1]}" in c.output()
    c.assert_no_orphans()
    c.assert_consistent(final=True)
    logs = flow_run_logs(c.prefect_api, c.name)
    assert f"step {STEPS}/{STEPS}: reward" in logs, logs[-3000:]
    assert "services: vLLM at" in logs and "done: held-out reward" in logs
