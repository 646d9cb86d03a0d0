"""Two "hosts" on this machine for the multi-node tests: Linux network and mount namespaces.

``two_hosts()`` makes two network namespaces joined by one veth pair, host 0 at ``10.231.7.1``
and host 1 at ``10.231.7.2`` (a private /30, no route anywhere else: the two can reach each
other and nothing more). Each host has a folder of its own holding its HOME, under /var/tmp:
not under /tmp, which host 1 replaces by a tmpfs of its own.

- Host 0 is the test's own host, as node 0 is the orchestrator's: while the hosts exist, the
  test's main thread is in host 0's network namespace (``setns``), so everything the test starts
  from it (node 0's launcher, an S3 endpoint, the test's HTTP clients) is on host 0. It shares
  the test's files, as node 0 shares the orchestrator's.
- Host 1 runs each command (``Host.wrap``) in host 1's network namespace and a mount namespace of
  its own: a fresh tmpfs on ``/tmp``, host 0's folder hidden, HOME, TMPDIR and PREFECT_HOME its
  own, a host name of its own. It sees nothing host 0 wrote but ``IMAGE`` (the checkout, its
  virtualenv and the interpreter that made it: the image every node has, bound read-only, also
  where it lives under /tmp) and what the test copied into its folder; anything else it gets
  from the run's object storage.
- Each host has its own GPU visibility (``two_hosts(visible=...)``): the ``CUDA_VISIBLE_DEVICES``
  its commands run with (a GPU work pool's worker given ``5,6``), or none. On these CPU machines
  no rank computes on it, but what a process resolves from it (a placed node's devices, which
  its launcher passes on to its ranks) shows on which host it was resolved.

Every namespace, link and folder is removed when the context exits, also on failure; the names
carry this process's id, and leftovers of dead test processes are removed first. Where
namespaces are not permitted (not root, no ``ip``, EPERM) ``two_hosts`` skips, saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.231.7.{}/30"
CLONE_NEWNET = 0x40000000
_PREFIX = "rfh"  # namespaces rfh<pid>-<n>, links rfh<pid>v<n>


def _image() -> tuple[Path, ...]:
    """The checkout (this file's), the virtualenv that runs the tests and the interpreter that
    made it: each outermost folder once (a ``.venv`` inside the checkout is the checkout's)."""
    found = {Path(p).resolve() for p in (Path(__file__).parents[1], sys.prefix, sys.base_prefix)}
    return tuple(sorted(p for p in found if not any(p != o and p.is_relative_to(o) for o in found)))


IMAGE = _image()


@dataclass
class Host:
    """One simulated host: its network namespace, its address and its own folder."""

    index: int
    netns: str
    address: str
    root: Path
    hidden: list[Path]  # other hosts' folders, hidden from this one
    visible: str | None = None  # its CUDA_VISIBLE_DEVICES; None: it sets none

    @property
    def home(self) -> Path:
        return self.root / "home"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host, with its HOME (host 0 shares the test's network and files)."""
        if self.index == 0:
            gpus = (
                ["-u", "CUDA_VISIBLE_DEVICES"]
                if self.visible is None
                else [f"CUDA_VISIBLE_DEVICES={self.visible}"]
            )
            return ["env", *gpus, f"HOME={self.home}", *argv]
        # The image is bound aside before the tmpfs covers /tmp (a checkout under /tmp would
        # vanish with it), and moved back to its own path, read-only, once /tmp is this host's.
        q = shlex.quote
        image = [(q(str(p)), q(str(self.root / "image" / str(i)))) for i, p in enumerate(IMAGE)]
        home = q(str(self.home))
        gpus = (
            "unset CUDA_VISIBLE_DEVICES"
            if self.visible is None
            else f"export CUDA_VISIBLE_DEVICES={q(self.visible)}"
        )
        steps = [
            f"hostname rollflow-host-{self.index}",
            *(f"mkdir -p {aside} && mount --bind {path} {aside}" for path, aside in image),
            "mount -t tmpfs rfh-tmp /tmp",
            *(f"mount -t tmpfs rfh-hidden {q(str(h))}" for h in self.hidden),
            *(
                f"mkdir -p {path} && mount --move {aside} {path} && mount -o remount,bind,ro {path}"
                for path, aside in image
            ),
            f"export HOME={home} TMPDIR=/tmp PREFECT_HOME={home}/.prefect",
            gpus,
            'exec "$@"',
        ]
        script = " && ".join(steps)
        return [
            *("ip", "netns", "exec", self.netns),
            *("unshare", "--mount", "--uts", "--propagation", "private"),
            *("sh", "-c", script, f"rollflow-host-{self.index}", *argv),
        ]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _skip_unless_permitted() -> None:
    if os.geteuid() != 0:
        pytest.skip("separate hosts need network namespaces: not root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("separate hosts need `ip` (iproute2) and `unshare` (util-linux)")


def _remove_leftovers() -> None:
    """Namespaces of test processes that died without their finalizer."""
    listing = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({_PREFIX}(\d+)-\d+)", listing, re.M):
        netns, pid = name
        if not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", netns, check=False)


class _NetnsOfThisThread:
    """Moves the calling thread into a network namespace, and back."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)

    def enter(self, netns: str) -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if self.libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def leave(self) -> None:
        try:
            if self.libc.setns(self.home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
        finally:
            os.close(self.home)


@contextlib.contextmanager
def two_hosts(
    visible: tuple[str | None, str | None] = (None, None),
) -> Iterator[tuple[Host, Host]]:
    """Host 0 (this thread's network from now on) and host 1, joined by one veth link; each
    host's commands with its ``CUDA_VISIBLE_DEVICES`` from ``visible`` (None: unset)."""
    _skip_unless_permitted()
    _remove_leftovers()
    pid = os.getpid()
    names = [f"{_PREFIX}{pid}-{i}" for i in range(2)]
    links = [f"{_PREFIX}{pid}v{i}" for i in range(2)]
    folder = Path(tempfile.mkdtemp(prefix=f"rollflow-hosts-{pid}-", dir="/var/tmp"))
    roots = [folder / f"host-{i}" for i in range(2)]
    made: list[str] = []
    netns = None
    try:
        try:
            hosts = _make(names, links, roots, made)
            for host, gpus in zip(hosts, visible, strict=True):
                host.visible = gpus
        except subprocess.CalledProcessError as err:
            pytest.skip(f"could not make the hosts' link: {' '.join(err.cmd)}: {err.stderr}")
        netns = _NetnsOfThisThread()
        netns.enter(names[0])
        yield hosts[0], hosts[1]
    finally:
        if netns is not None:
            netns.leave()
        for name in made:  # a namespace's veth end goes with it, and its peer with that
            _ip("netns", "del", name, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def _make(names: list[str], links: list[str], roots: list[Path], made: list[str]) -> list[Host]:
    for name in names:
        added = _ip("netns", "add", name, check=False)
        if added.returncode != 0:
            pytest.skip(f"network namespaces are not permitted here: {added.stderr.strip()}")
        made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
    _ip("link", "add", links[0], "netns", names[0], "type", "veth", "peer", "name", links[1],
        "netns", names[1])  # fmt: skip
    hosts = []
    for i, (name, link, root) in enumerate(zip(names, links, roots, strict=True)):
        address = SUBNET.format(i + 1)
        _ip("-n", name, "addr", "add", address, "dev", link)
        _ip("-n", name, "link", "set", link, "up")
        (root / "home").mkdir(parents=True)
        others = [r for r in roots if r != root]
        hosts.append(Host(i, name, address.split("/")[0], root, others))
    return hosts


@contextlib.contextmanager
def object_storage(host: Host) -> Iterator[str]:
    """An S3 endpoint (moto's server, one bucket ``rollflow``) on ``host``'s link address, which
    every host reaches: the run's storage, the only thing the hosts share. Yields its URL.

    fsspec runs every S3 request on one event-loop thread per process; one made before the test
    entered host 0's network could not reach this address, so a fresh one serves meanwhile.
    """
    import boto3
    import fsspec.asyn
    from moto.server import ThreadedMotoServer

    for key, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(key, value)  # inherited by the processes the test starts
    server = ThreadedMotoServer(ip_address=host.address, port=0)
    server.start()
    saved = fsspec.asyn.loop[0], fsspec.asyn.iothread[0]
    fsspec.asyn.loop[0] = fsspec.asyn.iothread[0] = None
    try:
        url = "http://{}:{}".format(*server.get_host_and_port())
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
            Bucket="rollflow"
        )
        yield url
    finally:
        loop = fsspec.asyn.loop[0]
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        fsspec.asyn.loop[0], fsspec.asyn.iothread[0] = saved
        server.stop()
