"""The separate hosts of the multi-node tests (tests/host_support.py) are what they claim."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from host_support import two_hosts


def _on(host, code: str) -> subprocess.CompletedProcess:
    argv = host.wrap([sys.executable, "-c", code])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_two_hosts_reach_each_other_only_and_share_no_files():
    mine = tempfile.NamedTemporaryFile(dir="/tmp", prefix="host0-")  # on host 0
    with two_hosts() as (host0, host1):
        # Host 0's side of the link answers host 1; loopback and host 0's files are its own.
        server = socket.create_server((host0.address, 0))
        port = server.getsockname()[1]
        threading.Thread(target=lambda: server.accept()[0].sendall(b"hi"), daemon=True).start()
        (host0.home / "secret").write_text("host 0")
        seen = _on(
            host1,
            "import os, socket, pathlib, sys\n"
            f"s = socket.create_connection(({host0.address!r}, {port}), timeout=10)\n"
            "print(s.recv(2).decode())\n"
            f"print(os.path.exists({mine.name!r}), os.path.exists({str(host0.home)!r} + '/secret'))\n"
            "print(os.environ['HOME'], socket.gethostname(), sorted(os.listdir('/tmp')))\n"
            "try:\n"
            "    socket.create_connection(('10.231.7.5', 9), timeout=1)\n"
            "except OSError as e:\n"
            "    print('elsewhere:', type(e).__name__)\n",
        )
        assert seen.returncode == 0, seen.stderr
        lines = seen.stdout.splitlines()
        assert lines[0] == "hi"
        assert lines[1] == "False False"  # neither host 0's /tmp nor its folder
        assert lines[2] == f"{host1.home} rollflow-host-1 []"
        assert lines[3].startswith("elsewhere:")  # nothing past the link
        names = host0.netns, host1.netns
        server.close()
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listing], "a namespace outlived the hosts"
    assert not Path(host0.root).exists() and not Path(host1.root).exists()
    mine.close()
