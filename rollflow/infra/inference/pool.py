"""Several vLLM servers behind one sampling interface.

Each sampling request (one group: a prompt and its ``n`` completions, so the group shares one
server's prefix cache) goes to the server with the fewest of this process's requests in flight,
among those whose serving gate is open (a server being restarted is passed over while another
serves). A pool of one server is the single-server case: there is one code path.

Invariant: ``lease()`` never hands out a server whose gate is closed while another's is open;
with every gate closed it hands out the least loaded one, whose client then waits at its gate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.inference.gate import serving_gate


class InferencePool:
    """Clients of every server of the deployment, and this process's load on each."""

    def __init__(self, clients: Sequence[InferenceClient]):
        if not clients:
            raise ValueError("an inference pool needs at least one server")
        self.clients = list(clients)
        self.in_flight = [0] * len(self.clients)
        self.requests = [0] * len(self.clients)  # leased so far, per server
        self._next = 0  # round-robin among equally loaded servers

    @classmethod
    def of(cls, urls: Sequence[str], **client_kwargs) -> InferencePool:
        return cls([InferenceClient(url, **client_kwargs) for url in urls])

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    @contextlib.contextmanager
    def lease(self) -> Iterator[InferenceClient]:
        """The server for one request; its in-flight count holds until the block ends."""
        i = self._pick()
        self.in_flight[i] += 1
        self.requests[i] += 1
        try:
            yield self.clients[i]
        finally:
            self.in_flight[i] -= 1

    def _pick(self) -> int:
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        open_ = [i for i in order if _is_open(self.clients[i])] or order
        best = min(open_, key=lambda i: self.in_flight[i])  # first of the least loaded
        self._next = (best + 1) % n
        return best

    def restarts(self) -> list[int]:
        """Completed restarts of each server (0 where no supervisor runs it)."""
        gates = [serving_gate(c.base_url) for c in self.clients]
        return [g.restarts if g else 0 for g in gates]

    def metrics(self) -> dict[str, float]:
        """Per-server figures for the step metrics (``inference/<i>/...``), when there are several."""
        if len(self.clients) == 1:
            return {}
        out: dict[str, float] = {}
        for i, (requests, restarts) in enumerate(zip(self.requests, self.restarts(), strict=True)):
            out[f"inference/{i}/requests"] = requests
            out[f"inference/{i}/restarts"] = restarts
        return out

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def _is_open(client: InferenceClient) -> bool:
    gate = serving_gate(client.base_url)
    return gate is None or gate.is_open
