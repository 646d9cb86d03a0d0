"""The separate hosts of the multi-node tests (tests/host_support.py) are what they claim."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from host_support import IMAGE, SUBNET, two_hosts


def _on(host, code: str) -> subprocess.CompletedProcess:
    argv = host.wrap([sys.executable, "-c", code])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _routes_past_the_link(host) -> list[str]:
    """The routes of ``host`` (every table, IPv4 and IPv6) that lead past its link: those that
    are not the link's own /30, IPv6's link-local /64 on the link, or the host's own addresses
    (table ``local``). Read from its routing tables, not by sending anything anywhere."""
    link = ipaddress.ip_network(SUBNET.format(0), strict=False)
    past = []
    for family in ("-4", "-6"):
        listing = subprocess.run(
            ["ip", "-n", host.netns, family, "route", "show", "table", "all"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        for route in listing.splitlines():
            to = route.split()[0]
            if " table local " in f"{route} " or to in (str(link), "fe80::/64"):
                continue
            past.append(route)
    return past


def test_two_hosts_reach_each_other_only_and_share_no_files():
    mine = tempfile.NamedTemporaryFile(dir="/tmp", prefix="host0-")  # on host 0
    with two_hosts(visible=("", "5,6")) as (host0, host1):
        # Host 0's side of the link answers host 1; loopback and host 0's files are its own.
        server = socket.create_server((host0.address, 0))
        port = server.getsockname()[1]
        threading.Thread(target=lambda: server.accept()[0].sendall(b"hi"), daemon=True).start()
        (host0.home / "secret").write_text("host 0")
        image = [str(p) for p in IMAGE]
        seen = _on(
            host1,
            "import os, socket, pathlib, sys\n"
            f"s = socket.create_connection(({host0.address!r}, {port}), timeout=10)\n"
            "print(s.recv(2).decode())\n"
            f"print(os.path.exists({mine.name!r}), os.path.exists({str(host0.home)!r} + '/secret'))\n"
            "print(os.environ['HOME'], socket.gethostname(), sorted(os.listdir('/tmp')))\n"
            f"print([bool(os.statvfs(p).f_flag & os.ST_RDONLY) for p in {image!r}])\n"
            "print(os.environ.get('CUDA_VISIBLE_DEVICES'))\n",
        )
        assert seen.returncode == 0, seen.stderr
        lines = seen.stdout.splitlines()
        assert lines[0] == "hi"
        assert lines[1] == "False False"  # neither host 0's /tmp nor its folder
        # Host 1's /tmp is its own: empty but for the way to the image where that is under /tmp.
        under_tmp = sorted({p.parts[2] for p in IMAGE if p.is_relative_to("/tmp")})
        assert lines[2] == f"{host1.home} rollflow-host-1 {under_tmp}"
        assert lines[3] == str([True] * len(IMAGE))  # the image: there, and read-only
        # Each host's own GPU visibility: a worker's 5,6 on host 1, '' (none) on host 0.
        assert lines[4] == "5,6"
        gpus0 = _on(host0, "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
        assert gpus0.stdout.strip() == "''", gpus0.stderr
        # Nothing past the link: no route but the link's (no default route), on either host.
        assert _routes_past_the_link(host0) == [] and _routes_past_the_link(host1) == []
        names = host0.netns, host1.netns
        server.close()
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listing], "a namespace outlived the hosts"
    assert not Path(host0.root).exists() and not Path(host1.root).exists()
    mine.close()
