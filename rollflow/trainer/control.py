"""The trainer's internal control plane: rank 0 tells every rank what to run next, and watches them.

``ControlGroup`` is a private gloo group (on GPU too: commands are host data) over which rank 0
broadcasts each command as JSON bytes and all ranks exchange small JSON results. Nothing is
pickled. Every collective carries the group's timeout, so a rank that stops answering is an
error after ``timeout_s``, never a hang.

``PeerWatch`` runs on rank 0 and polls the process ids of the ranks on its own host: a rank
that dies is named ("trainer rank 1 (pid 4242) died") within a fraction of a second, before any
collective notices, so the HTTP API can fail the pending call and the health check at once.
Ranks on other hosts are covered by the collective timeouts only.

The control group binds gloo to the interface that reaches ``MASTER_ADDR``
(``infra/network.py``), not the hostname's address (127.0.1.1 on stock Ubuntu).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from rollflow.infra.network import bind_gloo_interface

WATCH_INTERVAL_S = 0.2


class ControlGroup:
    """JSON broadcast and all-gather over a dedicated gloo group, each with a deadline."""

    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        bind_gloo_interface()  # not the hostname's address, which may be loopback
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (other ranks pass nothing)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.broadcast(size, src=0, group=self.group, async_op=True))
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(dist.broadcast(data, src=0, group=self.group, async_op=True))
        return obj if self.rank == 0 else json.loads(bytes(data.numpy()))

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(
            dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.group, async_op=True)
        )
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(chunks, padded, group=self.group, async_op=True))
        return [json.loads(bytes(c[: int(s)].numpy())) for c, s in zip(chunks, sizes, strict=True)]

    def _wait(self, work) -> None:
        work.wait(self.timeout)


def rank_identity() -> dict[str, Any]:
    return {"rank": dist.get_rank(), "pid": os.getpid(), "host": socket.gethostname()}


class PeerWatch:
    """Rank 0's watch over the other ranks' processes on its host.

    Invariant: once a watched rank's process is gone (or a zombie), ``failure`` names it within
    ``WATCH_INTERVAL_S``, and stays set.
    """

    def __init__(self, ranks: list[dict[str, Any]], log_hint: str = ""):
        host = socket.gethostname()
        self.peers = [r for r in ranks if r["rank"] != 0 and r["host"] == host]
        self.remote = [r["rank"] for r in ranks if r["host"] != host]
        self.log_hint = log_hint
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def fail(self, message: str) -> None:
        """Record the first failure (later ones keep the first, which is the cause)."""
        with self._lock:
            if self.failure is None:
                self.failure = message

    def poll(self) -> str | None:
        for peer in self.peers:
            if not pid_alive(peer["pid"]):
                self.fail(f"trainer rank {peer['rank']} (pid {peer['pid']}) died{self.log_hint}")
        return self.failure

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.poll()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not; one we may not inspect,
    another user's, does)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
