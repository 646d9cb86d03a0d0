"""Sampling while the inference fleet grows and shrinks (``infra/vllm_fleet/fleet.py``).

Servers are the fake OpenAI server; the run's services' part (a server joins the fleet, or is
taken out and stopped) is played by the test with known timings. The real grow and shrink
(vLLM servers started, joined to the weight group, preempted) is in
tests/integration/flows/test_scale_out.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollflow.infra.errors import InferenceGone, InferenceUnavailable
from rollflow.infra.metric_names import Metric
from rollflow.infra.vllm_fleet.fleet import Fleet
from rollflow.infra.vllm_fleet.gate import ServingGate, register_gate, unregister_gate
from rollflow.infra.vllm_fleet.pool import InferencePool
from rollflow.tasks.generate.rollouts import RetryPolicy, Sampler, SamplingStats
from rollflow.testing.fake_openai import FakeOpenAI


def test_a_server_that_leaves_mid_request_has_its_requests_retried_on_the_others_at_once():
    """Nothing is lost or answered twice, and no request waits out the unhealthy grace (60 s
    here) on the server that left: the next try goes to a member at once."""
    served: dict[str, list[int]] = {"leaving": [], "staying": []}
    leaving = FakeOpenAI(latency_s=2.0, faults=lambda p, a: served["leaving"].append(p[0]) or "ok")
    staying = FakeOpenAI(faults=lambda p, a: served["staying"].append(p[0]) or "ok")
    urls = [leaving.start(), staying.start()]
    lock = threading.Lock()
    gates = [register_gate(url, lock) for url in urls]
    fleet = Fleet(urls)
    stats = SamplingStats()
    try:

        async def main() -> list:
            pool = InferencePool.following(fleet, timeout_s=10)
            sample = Sampler(
                pool,
                max_tokens=4,
                temperature=1.0,
                top_p=1.0,
                stats=stats,
                deadline_s=60,
                retry=RetryPolicy(initial_s=0.01, max_s=0.05, unhealthy_grace_s=60),
            )
            try:
                tasks = [asyncio.create_task(sample([100 + i], n=2)) for i in range(8)]
                await asyncio.sleep(0.5)
                assert leaving.in_flight == 4, "the pool spreads requests over both servers"
                # The run's services take server 0 out as InferenceSupervisor.retire does: no new
                # lease, its gate retired and gone, the server stopped.
                fleet.remove(0)
                gates[0].retire("vLLM server 0 left the inference fleet")
                unregister_gate(gates[0])
                leaving.stop()
                start = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
                return results, time.monotonic() - start, pool.metrics()
            finally:
                await pool.aclose()

        results, took, metrics = asyncio.run(main())
    finally:
        for gate in gates:
            unregister_gate(gate)
        staying.stop()
    assert [len(r) for r in results] == [2] * 8
    assert took < 5, f"the cut requests took {took:.1f}s to finish elsewhere"
    assert sorted(served["leaving"]) == [100, 102, 104, 106]  # each reached it once, cut
    assert sorted(served["staying"]) == list(range(100, 108))  # every prompt answered once there
    assert stats.retries == 4
    assert metrics[Metric.INFERENCE_SERVERS] == 1
    assert metrics["inference/0/requests"] == 4 and metrics["inference/1/requests"] == 8


def test_a_server_that_joins_gets_requests_from_the_next_lease_and_its_time_to_the_first():
    fleet = Fleet(["http://127.0.0.1:9"])
    pool = InferencePool.following(fleet)
    with pool.lease() as first:
        assert first.base_url == "http://127.0.0.1:9"
    assert pool.metrics() == {Metric.INFERENCE_SERVERS: 1}
    time.sleep(0.05)
    fleet.add(3, "http://127.0.0.1:10")  # slot 3: the plan's, not a position
    with pool.lease() as a, pool.lease() as b:
        assert {a.base_url, b.base_url} == {"http://127.0.0.1:9", "http://127.0.0.1:10"}
    m = pool.metrics()
    assert m[Metric.INFERENCE_SERVERS] == 2
    assert m["inference/0/requests"] == 2 and m["inference/3/requests"] == 1
    assert 0 <= m["inference/3/first_request_s"] < 0.05 <= m["inference/0/first_request_s"] + 1
    fleet.remove(0)
    with pool.lease() as only:
        assert only.base_url == "http://127.0.0.1:10"
        assert not pool.serves(first) and pool.serves(only)
    assert pool.metrics()["inference/0/requests"] == 2  # a server that left keeps its count


def test_a_retired_gate_sends_its_waiters_elsewhere_and_a_failed_one_ends_them():
    retired, failed = ServingGate("http://a"), ServingGate("http://b")
    for gate in (retired, failed):
        gate.close(deadline_s=30)
    threading.Timer(0.1, retired.retire, ["vLLM server 1 left the inference fleet"]).start()
    threading.Timer(0.1, failed.fail, ["the run is stopping"]).start()
    with pytest.raises(InferenceUnavailable, match="left the inference fleet"):
        retired.wait_open(timeout_s=5)  # retryable: the Sampler tries another server
    with pytest.raises(InferenceGone):
        failed.wait_open(timeout_s=5)
    assert not retired.restarting  # no restart under way: the server is gone from the fleet
