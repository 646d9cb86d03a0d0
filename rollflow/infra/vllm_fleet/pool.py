"""The run's vLLM servers behind one sampling interface.

Each sampling request (one group: a prompt and its ``n`` completions, so the group shares one
server's prefix cache) goes to the server with the fewest of this process's requests in flight,
among the fleet's members (``fleet.py``) whose serving gate is open (a server being restarted is
passed over while another serves). The pool follows the fleet as it grows and shrinks: a server
that joined gets requests from its next lease on, one that left gets none, and a request that
was on it fails and is retried on a member (``Sampler``). A pool of one server is the
single-server case: there is one code path.

Invariant: ``lease()`` hands out only a member of the fleet, never one whose gate is closed
while another's is open; with every gate closed it hands out the least loaded member, whose
client then waits at its gate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

from rollflow.infra.metric_names import Metric
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.fleet import Fleet
from rollflow.infra.vllm_fleet.gate import serving_gate


class InferencePool:
    """Clients of the fleet's servers (made as they join), and this process's load on each."""

    def __init__(
        self,
        fleet: Fleet,
        make_client: Callable[[str], InferenceClient],
        clients: Sequence[InferenceClient] = (),
    ):
        if not len(fleet):
            raise ValueError("an inference pool needs at least one server")
        self.fleet, self._make_client = fleet, make_client
        self.clients: dict[int, InferenceClient] = {}  # slot → the client of its member now
        self._joined: dict[int, float] = {}  # slot → the join its client was made for
        self._retired: list[InferenceClient] = []  # clients of servers that left; closed last
        self.in_flight: dict[int, int] = {}
        self.requests: dict[int, int] = {}  # leased so far, per slot
        self.first_request_s: dict[int, float] = {}  # a join's time to its first request
        self._restarts: dict[tuple[int, float], int] = {}  # (slot, join) → its server's restarts
        self._next = 0  # round-robin among equally loaded servers
        given = {c.base_url.rstrip("/"): c for c in clients}
        self._follow(given)

    @classmethod
    def of(cls, urls: Sequence[str], **client_kwargs) -> InferencePool:
        """A pool of a fixed set of servers (a fleet of its own)."""
        return cls.following(Fleet(urls), **client_kwargs)

    @classmethod
    def following(cls, fleet: Fleet, **client_kwargs) -> InferencePool:
        """A pool of the run's fleet, as it changes."""
        return cls(fleet, lambda url: InferenceClient(url, **client_kwargs))

    @classmethod
    def around(cls, client: InferenceClient) -> InferencePool:
        """A pool of one existing client."""
        return cls(Fleet([client.base_url]), lambda url: client, [client])

    @property
    def urls(self) -> list[str]:
        return [
            self.clients[slot].base_url for slot in self.fleet.members() if slot in self.clients
        ]

    def serves(self, client: InferenceClient) -> bool:
        """Whether ``client``'s server is still a member (a request that failed on a server that
        left is retried on another without waiting for it)."""
        members = self.fleet.members()
        return any(c is client and slot in members for slot, c in self.clients.items())

    @contextlib.contextmanager
    def lease(self) -> Iterator[InferenceClient]:
        """The server for one request; its in-flight count holds until the block ends."""
        slot = self._pick()
        self.in_flight[slot] += 1
        self.requests[slot] += 1
        if slot not in self.first_request_s:
            self.first_request_s[slot] = time.monotonic() - self._joined[slot]
        try:
            yield self.clients[slot]
        finally:
            self.in_flight[slot] -= 1

    def _follow(self, given: dict[str, InferenceClient] | None = None) -> list[int]:
        """Clients for the fleet's members now (a slot that joined again gets a new one); returns
        the members' slots."""
        members = self.fleet.members()
        for slot, url in members.items():
            joined = self.fleet.joined_at.get(slot, 0.0)
            if slot in self.clients and self._joined[slot] == joined:
                continue
            if slot in self.clients:
                self._retired.append(self.clients[slot])
                self.first_request_s.pop(slot, None)
            self.clients[slot] = (given or {}).get(url) or self._make_client(url)
            self._joined[slot] = joined
            self.in_flight.setdefault(slot, 0)
            self.requests.setdefault(slot, 0)
        return list(members)

    def _pick(self) -> int:
        slots = self._follow()
        if not slots:
            raise RuntimeError("the inference fleet has no server")  # the run keeps one at least
        n = len(slots)
        order = [slots[(self._next + k) % n] for k in range(n)]
        open_ = [s for s in order if _is_open(self.clients[s])] or order
        best = min(open_, key=lambda s: self.in_flight[s])  # first of the least loaded
        self._next = (slots.index(best) + 1) % n
        return best

    def restarts(self) -> dict[int, int]:
        """Completed restarts of the server in each slot so far, including servers that have
        left (0 where no supervisor runs it)."""
        for slot, url in self.fleet.members().items():
            gate = serving_gate(url)
            if gate is not None:
                self._restarts[(slot, self.fleet.joined_at.get(slot, 0.0))] = gate.restarts
        out = dict.fromkeys(dict(self.requests), 0)
        for (slot, _), n in self._restarts.items():
            out[slot] = out.get(slot, 0) + n
        return out

    def metrics(self) -> dict[str, float]:
        """The fleet's size, and per-slot figures (``inference/<i>/...``) once there were several."""
        out: dict[str, float] = {Metric.INFERENCE_SERVERS: len(self.fleet)}
        restarts = self.restarts()
        if len(self.requests) == 1 and len(self.fleet) == 1:
            return out
        for slot, requests in sorted(dict(self.requests).items()):
            out[f"{Metric.INFERENCE}/{slot}/requests"] = requests
            out[f"{Metric.INFERENCE}/{slot}/restarts"] = restarts.get(slot, 0)
            if slot in self.first_request_s:
                out[f"{Metric.INFERENCE}/{slot}/first_request_s"] = self.first_request_s[slot]
        return out

    async def aclose(self) -> None:
        for client in {id(c): c for c in [*self.clients.values(), *self._retired]}.values():
            await client.aclose()


def _is_open(client: InferenceClient) -> bool:
    gate = serving_gate(client.base_url)
    return gate is None or gate.is_open
