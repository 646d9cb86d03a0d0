"""How ``sync_weights`` pauses several servers: together, and every paused one resumed; and
where ``join`` takes the weight group's port from.

Stand-in servers record the calls ``sync_weights`` makes (pause, collective_rpc, reset, resume);
the wire itself runs against real vLLM in test_weights.py and tests/integration/flows/test_scale_out.py.
"""

from __future__ import annotations

import asyncio

import pytest

from rollflow.infra.errors import PrefixCacheNotReset, WeightSyncError
from rollflow.tasks.sync.weights import sync_weights
from rollflow.trainer.protocol import SentReply


class Server:
    in_flight = 0  # pauses under way at once, across servers
    most_in_flight = 0

    def __init__(self, name: str, pause_fails: bool = False):
        self.name, self.pause_fails, self.calls = name, pause_fails, []

    async def pause(self, mode: str) -> None:
        Server.in_flight += 1
        Server.most_in_flight = max(Server.most_in_flight, Server.in_flight)
        try:
            await asyncio.sleep(0.05)  # a forward pass finishing
        finally:
            Server.in_flight -= 1
        if self.pause_fails:
            raise ConnectionError(f"{self.name}: connection refused")
        self.calls.append(f"pause:{mode}")

    async def collective_rpc(self, method: str, args: list[str], timeout_s: float) -> list[dict]:
        self.calls.append(method)
        return [{"version": 3}]

    async def reset_prefix_cache(self, deadline_s: float) -> int:
        self.calls.append("reset")
        return 1

    async def resume(self) -> None:
        self.calls.append("resume")


@pytest.fixture(autouse=True)
def _count():
    Server.in_flight = Server.most_in_flight = 0


async def _send() -> SentReply:
    return SentReply(version=3, bytes=10, broadcast_s=0.01)


def test_servers_pause_together_then_load_and_resume():
    servers = [Server("a"), Server("b"), Server("c")]
    out = asyncio.run(sync_weights(servers, _send, 3, timeout_s=5))
    assert out["version"] == 3 and out["bytes"] == 10 and out["cache_reset_tries"] == 1
    assert Server.most_in_flight == 3  # no server waits for another's pause
    for s in servers:
        assert s.calls == ["pause:keep", "receive_weights", "reset", "resume"]


def test_a_pause_that_fails_resumes_the_others_and_names_the_server():
    ok, dead = Server("a"), Server("b", pause_fails=True)
    with pytest.raises(ConnectionError, match="b: connection refused"):
        asyncio.run(sync_weights([ok, dead], _send, 3, timeout_s=5))
    assert ok.calls == ["pause:keep", "resume"]  # nothing loaded, and generation goes on
    assert dead.calls == []  # never paused: not resumed either


def test_a_server_that_loaded_another_version_fails_the_sync_and_is_resumed():
    class Stale(Server):
        async def collective_rpc(
            self, method: str, args: list[str], timeout_s: float
        ) -> list[dict]:
            return [{"version": 2}]

    servers = [Server("a"), Stale("b")]
    with pytest.raises(WeightSyncError, match=r"loaded versions \[3, 2\], expected 3"):
        asyncio.run(sync_weights(servers, _send, 3, timeout_s=5))
    assert all(s.calls[-1] == "resume" for s in servers)


def test_a_server_that_refuses_the_cache_reset_fails_the_sync_and_every_server_is_resumed():
    """KV of the old weights must never be read after a sync: a refused reset is an error."""

    class Refuses(Server):
        async def reset_prefix_cache(self, deadline_s: float) -> int:
            raise PrefixCacheNotReset(f"{self.name} refused to reset its prefix cache")

    servers = [Server("a"), Refuses("b")]
    with pytest.raises(PrefixCacheNotReset, match="b refused"):
        asyncio.run(sync_weights(servers, _send, 3, timeout_s=5))
    assert all(s.calls[-1] == "resume" for s in servers)


def test_the_weight_group_meets_at_a_port_the_trainer_chose_on_its_own_host(monkeypatch):
    """The store is hosted by the trainer's rank 0, which may run on another host than the run
    (a placed node 0): its port is asked of the trainer, not picked free where the run is."""
    from rollflow.tasks.sync import weights

    seen = {}

    class Source:
        def metadata(self):
            return []

        def weights_port(self):
            return 23456

        def weights_connect(self, host, port, world_size, timeout_s, wire_device, bucket_bytes):
            seen["connect"] = (host, port)
            return {"ok": True}

    async def init(clients, connect, spec, port, timeout_s, metadata):
        seen["group"] = port
        return await connect()

    monkeypatch.setattr(weights, "init_weight_group", init)
    spec = weights.GroupSpec(world_size=1, wire_device="cpu", bucket_bytes=1, host="192.0.2.2")
    assert weights.join(Source(), [], spec, timeout_s=5) == {"ok": True}
    assert seen == {"group": 23456, "connect": ("192.0.2.2", 23456)}
