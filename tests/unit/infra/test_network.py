"""The interface gloo binds to on several nodes (``network.socket_interface``): never the
hostname's address by default, which is 127.0.1.1 on stock Ubuntu and unreachable elsewhere."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.infra import network
from rollflow.infra.network import bind_gloo_interface, socket_interface

ROOT = Path(__file__).resolve().parents[3]

HOST = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["198.51.100.3", "fe80::1%eth0"],
    "ib0": ["203.0.113.5"],
}


def test_a_loopback_master_is_reached_through_lo():
    name, why = socket_interface("127.0.0.1", env={}, interfaces=HOST)
    assert name == "lo" and "127.0.0.1" in why


def test_a_master_on_another_host_is_reached_through_the_interface_that_routes_to_it():
    name, why = socket_interface(
        "198.51.100.9", env={}, interfaces=HOST, local_address="198.51.100.3"
    )
    assert name == "eth0" and "198.51.100.9" in why
    name, _ = socket_interface("203.0.113.1", env={}, interfaces=HOST, local_address="203.0.113.5")
    assert name == "ib0"


def test_the_hostname_address_is_never_the_default():
    """127.0.1.1 (the hostname on Ubuntu) is on no interface: no interface, not loopback."""
    name, why = socket_interface("198.51.100.9", env={}, interfaces=HOST, local_address="127.0.1.1")
    assert name is None and "127.0.1.1" in why


@pytest.mark.parametrize(
    ("env", "backend", "expected"),
    [
        ({"GLOO_SOCKET_IFNAME": "ib0"}, "gloo", "ib0"),
        ({"GLOO_SOCKET_IFNAME": "ib0,eth0", "NCCL_SOCKET_IFNAME": "eth0"}, "gloo", "ib0"),
        ({"NCCL_SOCKET_IFNAME": "ib0"}, "gloo", "ib0"),
        ({"NCCL_SOCKET_IFNAME": "=ib0"}, "gloo", "ib0"),
        ({"NCCL_SOCKET_IFNAME": "^docker"}, "gloo", "eth0"),  # NCCL's exclusion: not a name
        ({"NCCL_SOCKET_IFNAME": "ib"}, "gloo", "eth0"),  # NCCL's prefix: not a name for gloo
        ({"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0"}, "nccl", "ib0"),
    ],
)
def test_an_interface_named_in_the_environment_wins(env, backend, expected):
    name, why = socket_interface(
        "198.51.100.9", backend, env=env, interfaces=HOST, local_address="198.51.100.3"
    )
    assert name == expected
    assert ("SOCKET_IFNAME" in why) == (expected == "ib0")


def test_binding_names_the_interface_for_torch_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(network, "_host_interfaces", lambda: HOST)
    monkeypatch.setattr(network, "route_source", lambda addr: "198.51.100.3")
    with caplog.at_level(logging.INFO, logger=network.__name__):
        assert bind_gloo_interface("198.51.100.9") == "eth0"
    assert network.os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "binds to interface eth0" in caplog.text


def test_a_user_list_of_interfaces_stays_whole(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0")
    monkeypatch.setattr(network, "_host_interfaces", lambda: HOST)
    assert bind_gloo_interface("198.51.100.9") == "eth0"
    assert network.os.environ["GLOO_SOCKET_IFNAME"] == "eth0,ib0"


def test_an_unreachable_master_leaves_torch_its_default(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)

    def no_route(addr):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(network, "route_source", no_route)
    assert bind_gloo_interface("198.51.100.9") is None
    assert "GLOO_SOCKET_IFNAME" not in network.os.environ


def test_auto_master_addr_is_this_hosts_own_address(monkeypatch):
    """``trainer.master_addr = "auto"``: the default route's source; on a host whose only link
    is a private one (no default route), its first IPv4 that is not loopback or link-local."""
    from rollflow.infra.config import load_config
    from rollflow.infra.placement import resolve_addresses

    monkeypatch.setattr(network, "route_source", lambda addr: "192.0.2.9")
    assert network.own_address() == "192.0.2.9"

    def no_route(addr):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(network, "route_source", no_route)
    monkeypatch.setattr(
        network,
        "_host_interfaces",
        lambda: {
            "lo": ["127.0.0.1", "::1"],
            "eth0": ["fe80::1", "169.254.3.3", "10.231.7.1"],  # not connected to
        },
    )
    assert network.own_address() == "10.231.7.1"
    cfg = load_config(
        None, ["model.path='/m'", "envs=[{name='sort_letters'}]", "trainer.master_addr=auto"]
    )
    assert resolve_addresses(cfg).trainer.master_addr == "10.231.7.1"
    assert cfg.trainer.master_addr == "auto"  # what config.json keeps: a rerun resolves anew


# A host's own name in its /etc/hosts, as stock Ubuntu writes it.
UBUNTU_HOSTS = "127.0.0.1 localhost\n127.0.1.1 node-0\n192.0.2.10 node-1\n"
CHECK = (
    "import sys; from rollflow.infra.network import check_reachable_name\n"
    "try:\n    check_reachable_name(sys.argv[1])\nexcept Exception as e:\n"
    "    print(e); sys.exit(3)\nprint('ok')"
)


@pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root's unshare"
)
def test_a_master_addr_name_that_resolves_to_loopback_on_its_host_fails_at_once(tmp_path):
    """trainer.master_addr = "node-0" on a host whose /etc/hosts names itself 127.0.1.1: the
    rank fails at start naming the name, the address and what to do (gloo bound to loopback and
    node 1 waited request_timeout_s). Resolved for real, in a mount namespace with that file."""
    hosts = tmp_path / "hosts"
    hosts.write_text(UBUNTU_HOSTS)

    def check(name: str) -> subprocess.CompletedProcess:
        script = f'mount --bind {hosts} /etc/hosts && exec "$0" -c "$1" "$2"'
        return subprocess.run(
            ["unshare", "--mount", "sh", "-c", script, sys.executable, CHECK, name],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )

    loop = check("node-0")
    assert loop.returncode == 3, loop.stderr
    assert "trainer.master_addr = 'node-0' resolves to 127.0.1.1" in loop.stdout
    assert "map node-0 to that address in /etc/hosts" in loop.stdout
    assert check("node-1").stdout.strip() == "ok"  # another host's address: resolved, no traffic
    literal = check("127.0.0.1")
    assert literal.returncode == 3 and "is a loopback address" in literal.stdout
