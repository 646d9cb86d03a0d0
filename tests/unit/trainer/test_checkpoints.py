"""Checkpoints on several hosts that share no file system (item 9 of issue 26).

The pure parts (who uploads which file, how failures are named) and ``CheckpointOps`` itself with
two ranks as threads, each on a "host" of its own (its own temp folder), against an object store
(fsspec's memory file system). The same on real processes in separate network and mount
namespaces: tests/integration/trainer/test_trainer_service.py, configuration fsdp2-2nodes.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from rollflow.infra.errors import StorageError
from rollflow.infra.storage import SUCCESS, RunStorage
from rollflow.trainer import checkpoints
from rollflow.trainer.checkpoints import CheckpointOps, assign_uploads, failures, staged_files
from rollflow.trainer.protocol import StepRef


def test_on_one_file_system_the_first_rank_uploads_everything():
    seen = ["model.safetensors", "trainer/a", "trainer/b"]
    assert assign_uploads([seen, seen, seen]) == [seen, [], []]


def test_on_separate_hosts_each_host_uploads_what_its_ranks_wrote():
    node0 = ["model.safetensors", "trainer/__0_0.distcp", "trainer/__1_0.distcp"]
    node1 = ["trainer/__2_0.distcp", "trainer/__3_0.distcp"]
    assert assign_uploads([node0, node0, node1, node1]) == [node0, [], node1, []]


def test_every_file_is_uploaded_exactly_once():
    listings = [["a", "b"], ["b", "c"], ["c", "d"], []]
    assigned = assign_uploads(listings)
    flat = [f for files in assigned for f in files]
    assert sorted(flat) == ["a", "b", "c", "d"] and len(flat) == len(set(flat))


def test_failures_name_every_failed_rank():
    assert failures([None, None]) is None
    assert failures([None, "OSError: disk full", None, "timeout"]) == (
        "rank 1: OSError: disk full; rank 3: timeout"
    )


def test_staged_files_are_relative_and_sorted(tmp_path):
    (tmp_path / "trainer" / "dcp").mkdir(parents=True)
    (tmp_path / "trainer" / "dcp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    assert staged_files(tmp_path) == ["model.safetensors", "trainer/dcp/__0_0.distcp"]


# ------------------------------------------------------------- two hosts as two threads


class Hosts:
    """Rank r runs in a thread on host r: its own temp folder; collectives through a barrier."""

    def __init__(self, root: Path, world_size: int):
        self.root, self.world_size = root, world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list = [None] * world_size
        self.here = threading.local()

    def tmp(self) -> str:
        folder = self.root / f"host-{self.here.rank}" / "tmp"
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder)

    def __fspath__(self) -> str:
        """This host's ``~/.cache`` (the ranks read ``LOCAL_CHECKPOINTS`` as of their host)."""
        return str(self.root / f"host-{self.here.rank}" / "cache")

    def path(self, rank: int, path: str | Path) -> Path:
        """``path`` as rank ``rank`` sees it: host 0 is this machine; on another host a path
        outside its own folder is one of its private disk, not what host 0 holds there."""
        path, own = Path(path), self.root / f"host-{rank}"
        if rank == 0 or path.is_relative_to(own):
            return path
        return own / "disk" / path.relative_to("/")

    def exchange(self, rank: int, obj):
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def run(self, work) -> list:
        results: list = [None] * self.world_size

        def one(rank: int) -> None:
            self.here.rank = rank
            try:
                results[rank] = work(rank)
            except Exception as err:  # noqa: BLE001 - reported to the test
                results[rank] = err

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return results


class Control:
    def __init__(self, hosts: Hosts, rank: int):
        self.hosts, self.rank, self.world_size = hosts, rank, hosts.world_size

    def broadcast(self, obj=None):
        return self.hosts.exchange(self.rank, obj)[0]

    def all_gather(self, obj):
        return self.hosts.exchange(self.rank, obj)


class FakeTrainer:
    """Writes what a backend's ranks write: rank 0 the HF export and metadata, each rank a shard."""

    def __init__(self, control: Control):
        self.control, self.rank, self.step, self.loaded = control, control.rank, 3, None

    def save_checkpoint(self, folder: Path) -> None:
        folder = self.control.hosts.path(self.rank, folder)
        (folder / "trainer").mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (folder / "model.safetensors").write_bytes(b"weights")
            (folder / "trainer" / ".metadata").write_bytes(b"meta")
        (folder / "trainer" / f"__{self.rank}_0.distcp").write_bytes(f"shard {self.rank}".encode())
        self.control.all_gather(None)  # the barrier that ends every rank's writes

    def load_checkpoint(self, folder: Path) -> None:
        self.loaded = staged_files(self.control.hosts.path(self.rank, folder))


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    hosts = Hosts(tmp_path, 2)
    monkeypatch.setattr(checkpoints.tempfile, "gettempdir", hosts.tmp)
    monkeypatch.setattr(checkpoints, "LOCAL_CHECKPOINTS", hosts)
    return hosts


def _ops(hosts: Hosts, storage: RunStorage, rank: int, trainer_cls=FakeTrainer) -> CheckpointOps:
    control = Control(hosts, rank)
    return CheckpointOps(trainer_cls(control), control, storage)


def test_a_checkpoint_on_two_hosts_holds_every_ranks_shards(two_hosts):
    storage = RunStorage(f"memory://ckpt-{uuid.uuid4().hex}", "t")

    ops = two_hosts.run(lambda rank: _ops(two_hosts, storage, rank))
    saved = two_hosts.run(lambda rank: ops[rank].save_checkpoint(StepRef(step=5)))
    # The next command, as rank 0 broadcasts it once the save has answered:
    loaded = two_hosts.run(lambda rank: ops[rank].load_checkpoint(StepRef(step=5)))
    assert not [r for r in saved + loaded if isinstance(r, Exception)], saved + loaded
    assert saved[0]["uri"].endswith("checkpoints/step=5") and storage.is_committed("checkpoints", 5)
    expected = [
        "model.safetensors",
        "trainer/.metadata",
        "trainer/__0_0.distcp",
        "trainer/__1_0.distcp",
    ]
    remote = storage.step_dir("checkpoints", 5)
    assert (
        sorted(p[len(remote) + 1 :] for p in storage.fs.find(remote) if not p.endswith(SUCCESS))
        == expected
    )
    # Each rank reads every file, from a copy on its host:
    assert ops[0].trainer.loaded == ops[1].trainer.loaded == sorted([*expected, SUCCESS])
    for rank in (0, 1):  # the staging folders are gone from both hosts
        assert not list(Path(two_hosts.path(rank, two_hosts.root / f"host-{rank}/tmp")).iterdir())


def test_a_failed_upload_on_one_host_leaves_the_checkpoint_uncommitted(two_hosts, monkeypatch):
    storage = RunStorage(f"memory://ckpt-{uuid.uuid4().hex}", "t")
    upload = storage.upload_files

    def flaky(local, files, kind, step):
        if any("__1_0" in f for f in files):
            raise OSError("host 1 lost the endpoint")
        return upload(local, files, kind, step)

    monkeypatch.setattr(storage, "upload_files", flaky)
    results = two_hosts.run(
        lambda rank: _ops(two_hosts, storage, rank).save_checkpoint(StepRef(step=6))
    )
    assert all(isinstance(r, StorageError) for r in results), results
    assert "rank 1: OSError: host 1 lost the endpoint" in str(results[0])
    assert not storage.is_committed("checkpoints", 6)


def test_staging_of_a_rank_killed_mid_save_is_swept_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from rollflow.trainer.checkpoints import sweep_stale_staging

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    for name, pid in (
        ("rollflow-ckpt-3-dead", gone.stdout.strip()),
        ("rollflow-ckpt-4-live", os.getpid()),
    ):
        (tmp_path / name / "trainer").mkdir(parents=True)
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 10)
        (tmp_path / f"{name}.pid").write_text(str(pid))
    (tmp_path / "rollflow-ckpt-2-older").mkdir()  # no owner file: left alone
    assert sweep_stale_staging(tmp_path) == [tmp_path / "rollflow-ckpt-3-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rollflow-ckpt-2-older",
        "rollflow-ckpt-4-live",
        "rollflow-ckpt-4-live.pid",
    ]
