"""A restarted server that comes back at another URL (its flow run placed on another host by a
Kubernetes or Docker pool: flows/inference_server.py): the supervisor moves its gate and the fleet's
entry to the new URL under the weight group's lock, and the requests that waited at the old gate
are sent on (``InferenceUnavailable``: retried on a member). The real restart path (a server's
flow run submitted again) runs in tests/integration/flows/test_scale_out.py's two-host run,
where a queue per host keeps the address."""

from __future__ import annotations

import threading

from rollflow.infra.config import load_config
from rollflow.infra.errors import InferenceUnavailable
from rollflow.infra.vllm_fleet.fleet import Fleet
from rollflow.infra.vllm_fleet.gate import serving_gate, unregister_gate
from rollflow.services.vllm_supervisor import InferenceSupervisor, WeightLink


class Placed:
    """A server whose every start lands at the next address of ``urls``."""

    log_path = "its flow run's log"

    def __init__(self, urls: list[str]):
        self.urls, self.url, self.alive = list(urls), urls[0], True

    def spawn(self):
        self.alive = True

    def wait_ready(self):
        return self

    def start(self):
        self.url = self.urls.pop(1)
        self.alive = True

    def stop(self, timeout_s=0):
        self.alive = False

    def is_alive(self):
        return self.alive

    def ended(self):
        return "its flow run ended CRASHED"


def test_a_server_restarted_at_another_url_takes_its_gate_and_fleet_entry_along(monkeypatch):
    cfg = load_config(
        None, ["model.path='/m'", "envs=[{name='sort_letters'}]", "inference.max_restarts=2"]
    )
    old, new = "http://192.0.2.5:8000", "http://192.0.2.9:8000"
    fleet, lock, moved, restarted = Fleet({1: old}), threading.Lock(), [], []

    def follow(slot, url):
        assert lock.locked()  # a sync reading the fleet under the lock sees the group's servers
        moved.append((slot, url))
        fleet.add(slot, url)

    sup = InferenceSupervisor(
        cfg,
        "/m",
        None,
        index=1,
        server=Placed([old, new]),
        on_restart=restarted.append,
        progress=lambda line: None,
    )
    sup.spawn()
    sup.open_gate(WeightLink(rejoin=lambda: 3, lock=lock, moved=follow))
    old_gate = sup.gate
    old_gate.close(60.0)  # a request waits at the old gate while the server is down
    waiter_error = []

    def wait():
        try:
            old_gate.wait_open(timeout_s=30)
        except InferenceUnavailable as exc:
            waiter_error.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    sup.server.alive = False  # its flow run crashed
    try:
        sup.check()
        waiter.join(timeout=10)
        assert moved == [(1, new)] and fleet.members() == {1: new}
        assert serving_gate(old) is None and serving_gate(new) is sup.gate and sup.gate.is_open
        assert sup.gate.restarts == 1 and sup.restarts == 1
        assert [(r["url"], r["version"]) for r in restarted] == [(new, 3)]
        assert waiter_error and "moved to http://192.0.2.9:8000" in str(waiter_error[0])
    finally:
        unregister_gate(sup.gate)
