"""Ctrl-C (SIGINT) and SIGTERM at a seeded random point of a step.

The run must stop within 30 s, leave no process behind, commit nothing half-written, and print
one line (no traceback) saying what is committed and the command that resumes it; the resumed
run then continues after the last committed step.
"""

from __future__ import annotations

import signal
import time

import pytest
from test_chaos import SEED, STEPS, Campaign

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, model_cache) -> Campaign:
    from rollflow.infra.prefect_api import local_prefect_api

    with local_prefect_api() as prefect_api:
        c = Campaign(tmp_path_factory.mktemp("signals"), model_cache, prefect_api)
        yield c
        c.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_at_a_random_point_of_a_step_prints_one_line(campaign, signum):
    c = campaign
    before = c.committed()
    step = len(before) + 1
    proc = c.launch("train.max_staleness=1")
    name, reached, delay = c.random_kill_point(step)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    proc.send_signal(signum)
    sent = time.monotonic()
    proc.wait(timeout=60)
    took = time.monotonic() - sent
    print(f"seed {SEED}: {signal.Signals(signum).name} {delay}s after {name}; exit in {took:.1f}s")
    c.assert_no_orphans()
    c.assert_consistent()
    out = c.output()
    assert took < 30, out[-3000:]
    assert proc.returncode == 128 + signum, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("error")], out[-3000:]
    how = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    stopped = [line for line in out.splitlines() if line.startswith("stopped")]
    steps = c.committed()
    done = (
        f"committed through step {steps[-1]} of {STEPS} in {c.run_dir}"
        if steps
        else f"no step committed yet in {c.run_dir}"
    )
    resume = f"rollflow run {c.config} train.max_staleness=1"
    assert stopped == [f"stopped by {how}: {done}; resume with: {resume}"], out[-3000:]


def test_the_printed_command_resumes_and_the_run_logs_reach_prefect(campaign):
    """The rerun resumes after the last committed step and finishes; its progress lines are in
    its flow run's logs on the Prefect API (what the UI's Logs tab shows)."""
    c = campaign
    last = (c.committed() or [0])[-1]
    proc = c.launch()
    assert proc.wait(timeout=600) == 0, c.output()[-3000:]
    if last:
        assert f"resuming after committed step {last}" in c.output()
    c.assert_consistent(final=True)
    logs = flow_run_logs(c.prefect_api, "chaos")
    assert f"step {STEPS}/{STEPS}: reward" in logs, logs[-3000:]
    assert "services: vLLM at" in logs and "done: held-out reward" in logs


def flow_run_logs(api: str, run_name: str) -> str:
    """Every log message of the flow runs named ``run_name``, read back from the Prefect API."""
    import httpx

    runs = httpx.post(
        f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [run_name]}}}, timeout=10
    ).json()
    ids = [r["id"] for r in runs]
    messages, offset = [], 0
    while True:
        page = httpx.post(
            f"{api}/logs/filter",
            json={"logs": {"flow_run_id": {"any_": ids}}, "offset": offset, "limit": 200},
            timeout=10,
        ).json()
        messages += [log["message"] for log in page]
        offset += len(page)
        if len(page) < 200:
            return "\n".join(messages)
