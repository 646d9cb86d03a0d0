"""Which network interface gloo binds to, so that the other nodes can reach it.

torch's default gloo device takes the address the hostname resolves to: 127.0.1.1 on stock
Ubuntu, a loopback address no other node can reach, so a two-node group would fail or hang.
``socket_interface`` picks the interface named in ``GLOO_SOCKET_IFNAME`` (or an exact
``NCCL_SOCKET_IFNAME``), else the one that holds the local address the kernel routes to
``master_addr`` from. ``gloo_device`` (the weight group) and ``bind_gloo_interface`` (torch's own
gloo groups, which read ``GLOO_SOCKET_IFNAME``) use it and log which interface and why.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from rollflow.infra.errors import InputError

logger = logging.getLogger(__name__)

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
        local_address = route_source(master_addr)
    local = ipaddress.ip_address(local_address.split("%")[0])
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == local for a in addresses):
            return name, f"it holds {local_address}, the local address that reaches {master_addr}"
    return None, f"no interface holds {local_address} (the local address toward {master_addr})"


def route_source(master_addr: str) -> str:
    """The local address the kernel would send from to reach ``master_addr``."""
    info = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
        probe.connect(info[4])  # UDP: picks a route, sends nothing
        return probe.getsockname()[0]


def check_reachable_name(master_addr: str, what: str = "trainer.master_addr") -> None:
    """Raise ``InputError`` when ``master_addr``, a host name that other hosts must reach, resolves
    to a loopback address here (or is one): on stock Ubuntu a host's own name is 127.0.1.1 in
    /etc/hosts, so gloo bound to loopback and the other nodes waited for it until their
    deadline. Called where it is used, on the host whose /etc/hosts counts."""
    try:
        literal = ipaddress.ip_address(master_addr)
    except ValueError:
        literal = None
    if literal is not None:
        if literal.is_loopback:
            raise InputError(
                f"{what} = {master_addr!r} is a loopback address, which the other hosts cannot "
                f"reach: set {what} to this host's address as they reach it"
            )
        return
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(master_addr, None)}
    except OSError as err:
        raise InputError(f"{what} = {master_addr!r} does not resolve on this host: {err}") from None
    loopback = sorted(a for a in resolved if ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if loopback:
        raise InputError(
            f"{what} = {master_addr!r} resolves to {', '.join(loopback)} on this host "
            f"({socket.gethostname()}; its /etc/hosts), a loopback address the other hosts "
            f"cannot reach: set {what} to this host's address as they reach it, or map "
            f"{master_addr} to that address in /etc/hosts"
        )


def own_address() -> str:
    """This host's address as other hosts reach it: the source of its default route, else its
    first IPv4 address that is neither loopback nor link-local (a host whose only link is a
    private one), else 127.0.0.1. What ``trainer.master_addr = "auto"`` becomes."""
    try:
        return route_source("192.0.2.1")  # TEST-NET-1: only the route is looked up
    except OSError:
        pass
    for addresses in _host_interfaces().values():
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%")[0])
            if ip.version == 4 and not (ip.is_loopback or ip.is_link_local):
                return address
    return "127.0.0.1"


def _host_interfaces() -> dict[str, list[str]]:
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def _choose(master_addr: str) -> tuple[str | None, str]:
    try:
        return socket_interface(master_addr)
    except (OSError, ValueError) as err:
        return None, f"no route to {master_addr}: {err}"


def gloo_device(master_addr: str) -> Any:
    """A gloo device bound to the interface that reaches ``master_addr`` (``socket_interface``);
    torch's default device (the hostname's address) when none is found."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    name, why = _choose(master_addr)
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
    name, why = _choose(master_addr)
    if name is None:
        logger.warning("gloo toward %s: torch's default interface (%s)", master_addr, why)
        return None
    if not os.environ.get("GLOO_SOCKET_IFNAME"):  # the user's list, when set, stays whole
        os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info("gloo toward %s binds to interface %s (%s)", master_addr, name, why)
    return name
