"""The trainer's internal control plane: rank 0 tells every rank what to run next, and watches them.

``ControlGroup`` is a private gloo group (on GPU too: commands are host data) over which rank 0
broadcasts each command as JSON bytes and all ranks exchange small JSON results. Nothing is
pickled. Every collective carries the group's timeout, so a rank that stops answering is an
error after ``timeout_s``, never a hang.

``PeerWatch`` runs on rank 0 and polls the process ids of the ranks on its own host: a rank
that dies is named ("trainer rank 1 (pid 4242) died") within a fraction of a second, before any
collective notices, so the HTTP API can fail the pending call and the health check at once.
Ranks on other hosts are covered by the collective timeouts only.

``socket_interface`` picks the network interface gloo binds to on several nodes: torch's default
is the address the hostname resolves to, 127.0.1.1 on stock Ubuntu, which the other nodes cannot
reach. It is the interface that holds the local address routing to ``master_addr``, unless
``GLOO_SOCKET_IFNAME`` (or ``NCCL_SOCKET_IFNAME``) names one; the choice is logged.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
IFNAME_ENVS = {
    "gloo": ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),
    "nccl": ("NCCL_SOCKET_IFNAME",),
}


def socket_interface(
    master_addr: str,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    interfaces: Mapping[str, list[str]] | None = None,
    local_address: str | None = None,
) -> tuple[str | None, str]:
    """The interface to bind to so that ``master_addr`` is reachable: ``(name, why)``.

    An interface named in the backend's environment variable wins (gloo honours
    ``NCCL_SOCKET_IFNAME`` too, so one setting serves both). Otherwise the one holding the local
    address the kernel routes to ``master_addr`` from (``local_address``, found with a UDP
    "connect" that sends nothing). ``interfaces`` maps names to their IPv4/IPv6 addresses (the
    host's, by default). ``name`` is None when no interface holds that address.
    """
    env = os.environ if env is None else env
    if interfaces is None:
        interfaces = _host_interfaces()
    for var in IFNAME_ENVS[backend]:
        name = (env.get(var) or "").split(",")[0].strip()
        if var.startswith("NCCL") and backend == "gloo":
            # NCCL's syntax (prefixes, "^" to exclude) names no interface for gloo unless exact.
            name = name.removeprefix("=")
            if name not in interfaces:
                continue
        if name:
            return name, f"{var}={env[var]}"
    if local_address is None:
        local_address = _route_source(master_addr)
    local = ipaddress.ip_address(local_address.split("%")[0])
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == local for a in addresses):
            return name, f"it holds {local_address}, the local address that reaches {master_addr}"
    return None, f"no interface holds {local_address} (the local address toward {master_addr})"


def _route_source(master_addr: str) -> str:
    """The local address the kernel would send from to reach ``master_addr``."""
    info = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
        probe.connect(info[4])  # UDP: picks a route, sends nothing
        return probe.getsockname()[0]


def _host_interfaces() -> dict[str, list[str]]:
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def gloo_device(master_addr: str) -> Any:
    """A gloo device bound to the interface that reaches ``master_addr`` (``socket_interface``);
    torch's default device (the hostname's address) when none is found."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    try:
        name, why = socket_interface(master_addr)
    except (OSError, ValueError) as err:
        name, why = None, f"no route to {master_addr}: {err}"
    if name is None:
        logger.warning("gloo toward %s: default device (%s)", master_addr, why)
        return ProcessGroupGloo.create_default_device()
    logger.info("gloo toward %s binds to interface %s (%s)", master_addr, name, why)
    return ProcessGroupGloo.create_device(interface=name)


def bind_gloo_interface(master_addr: str | None = None) -> str | None:
    """Before a gloo group is made with torch's defaults (``init_process_group``, ``new_group``):
    name the interface that reaches ``master_addr`` (``MASTER_ADDR`` by default) in
    ``GLOO_SOCKET_IFNAME``, which torch reads then. Returns the interface, None if none found."""
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        name, why = socket_interface(master_addr)
    except (OSError, ValueError) as err:
        name, why = None, f"no route to {master_addr}: {err}"
    if name is None:
        logger.warning("gloo toward %s: torch's default interface (%s)", master_addr, why)
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info("gloo toward %s binds to interface %s (%s)", master_addr, name, why)
    return name


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
            if not _alive(peer["pid"]):
                self.fail(f"trainer rank {peer['rank']} (pid {peer['pid']}) died{self.log_hint}")
        return self.failure

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.poll()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
