"""Sampling through an inference restart: cut requests are retried, wait at the serving gate while
the server is down, and reach the new server only once its supervisor opens the gate.

The server is the fake OpenAI server, stopped and started again on the same port; the
supervisor's part (close, restart, re-sync, open) is played by a thread with known timings.
The real restart (vLLM killed, restarted, re-synced) is in tests/integration/flows/test_chaos_run.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollflow.infra.errors import InferenceGone
from rollflow.infra.processes import free_port
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.gate import register_gate, unregister_gate
from rollflow.services.run_services import DETECTION_BOUND_S
from rollflow.tasks.generate.rollouts import RetryPolicy, Sampler, SamplingStats
from rollflow.testing.fake_openai import FakeOpenAI

pytestmark = pytest.mark.chaos
GRACE_S = 1.0  # the Sampler's unhealthy grace here; the restart keeps the gate closed longer


@pytest.fixture
def url_and_gate():
    url = f"http://127.0.0.1:{free_port()}"
    gate = register_gate(url)
    yield url, gate
    unregister_gate(gate)


def sampler(client: InferenceClient, stats: SamplingStats) -> Sampler:
    return Sampler(
        client,
        max_tokens=4,
        temperature=1.0,
        top_p=1.0,
        stats=stats,
        deadline_s=60,
        retry=RetryPolicy(initial_s=0.01, max_s=0.05, unhealthy_grace_s=GRACE_S),
    )


def test_requests_cut_by_a_restart_wait_at_the_gate_and_complete_on_the_new_server(url_and_gate):
    url, gate = url_and_gate
    port = int(url.rsplit(":", 1)[1])
    arrivals: list[float] = []  # when each request reached the new server
    old = FakeOpenAI(latency_s=1.0, port=port)
    new = FakeOpenAI(
        port=port, faults=lambda prompt, attempt: arrivals.append(time.monotonic()) or "ok"
    )
    opened_at: list[float] = []

    def supervisor() -> None:  # the server dies; noticed 0.3 s later; down for 2 x the grace
        old.stop()
        time.sleep(0.3)
        gate.close(deadline_s=30)
        time.sleep(2 * GRACE_S)
        new.start()
        time.sleep(0.3)  # weight group + re-sync
        opened_at.append(time.monotonic())
        gate.open()

    stats = SamplingStats()

    async def main():
        async with InferenceClient(url, timeout_s=10) as client:
            sample = sampler(client, stats)
            tasks = [asyncio.create_task(sample([10 + i], n=2)) for i in range(8)]
            await asyncio.sleep(0.3)  # all eight in flight on the old server
            assert old.in_flight == 8
            restart = threading.Thread(target=supervisor)
            restart.start()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            restart.join()
            return results

    old.start()
    try:
        results = asyncio.run(main())
    finally:
        old.stop()
        new.stop()
    assert all(len(r) == 2 and r[0].finish_reason == "stop" for r in results)
    assert stats.retries >= 8  # every cut request retried at least once
    assert len(arrivals) == 8 and min(arrivals) >= opened_at[0]  # none before the gate opened
    assert gate.restarts == 1


def test_a_failed_restart_ends_the_requests_waiting_at_the_gate_at_once(url_and_gate):
    url, gate = url_and_gate
    gate.close(deadline_s=60)
    threading.Timer(
        0.5, gate.fail, args=("the vLLM server died and could not be restarted",)
    ).start()

    async def main():
        async with InferenceClient(url, timeout_s=10) as client:
            start = time.monotonic()
            with pytest.raises(InferenceGone, match="could not be restarted"):
                await sampler(client, SamplingStats())([10])
            return time.monotonic() - start

    assert asyncio.run(main()) < 2.0


def test_an_unsupervised_dead_server_is_dead_after_the_grace():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens, no gate: no restart will come

    async def main():
        async with InferenceClient(url, timeout_s=5) as client:
            start = time.monotonic()
            with pytest.raises(InferenceGone, match="not being restarted"):
                await sampler(client, SamplingStats())([10])
            return time.monotonic() - start

    assert GRACE_S <= asyncio.run(main()) < GRACE_S + 2.0


def test_a_failed_sync_waits_for_the_restart_it_caused(url_and_gate):
    _, gate = url_and_gate
    assert gate.wait_restart(gate.restarts, notice_s=0.2) is False  # no restart: the error stands

    def restart() -> None:
        time.sleep(0.2)
        gate.close(deadline_s=30)
        time.sleep(0.3)
        gate.open()

    start = time.monotonic()  # before the thread starts: it sleeps 0.5 s in all before reopening
    threading.Thread(target=restart).start()
    assert gate.wait_restart(0, notice_s=5) is True
    assert time.monotonic() - start >= 0.5 and gate.restarts == 1 and gate.is_open
    gate.close(deadline_s=30)
    gate.fail("gone")
    with pytest.raises(InferenceGone):
        gate.wait_restart(1, notice_s=1)


def test_the_sampler_grace_outlasts_the_supervisors_detection():
    """Requests fail on a dead server until the supervisor notices it (at most one health-check
    interval and one probe); only then does the gate hold them. The grace must cover that."""
    assert RetryPolicy().unhealthy_grace_s > DETECTION_BOUND_S
