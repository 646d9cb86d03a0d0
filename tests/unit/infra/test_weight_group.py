"""The weight group alone (no server): a sender and a receiver in one process, over gloo."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import pytest
import torch

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.processes import free_port
from rollflow.infra.weights import group as group_module
from rollflow.infra.weights.group import (
    Piece,
    WeightReceiverGroup,
    WeightSender,
    bucket_layout,
    weight_metadata,
)

SECRET = "the-run-token"


def _pair(timeout_s: float = 10.0) -> tuple[WeightSender, WeightReceiverGroup]:
    port = free_port()
    sender = WeightSender("127.0.0.1", port, 2, timeout_s, secret=SECRET)
    receiver = WeightReceiverGroup("127.0.0.1", port, 1, 2, timeout_s, secret=SECRET)
    joiner = threading.Thread(target=receiver.connect)
    joiner.start()
    sender.connect()
    joiner.join(timeout_s)
    return sender, receiver


def test_weight_group_round_trip_keeps_order_shapes_and_dtypes():
    tensors = {
        "a.weight": torch.randn(3, 4),
        "b.half": torch.randn(5).to(torch.bfloat16),
        "c.bias": torch.randn(7),
    }
    metadata = weight_metadata(tensors.items())
    assert json.loads(json.dumps(metadata))[1] == {
        "name": "b.half",
        "shape": [5],
        "dtype": "bfloat16",
    }
    sender, receiver = _pair()
    got = {}

    def receive():
        version, named = receiver.receive(metadata)
        got.update(named, version=version)

    thread = threading.Thread(target=receive)
    thread.start()
    num_bytes = sender.broadcast(tensors.items(), version=7)
    thread.join(10)
    sender.close()
    receiver.close()
    assert got.pop("version") == 7
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    # a: 48 bytes at 0, b: 10 at 64, c: 28 at 128 (each tensor starts at a 64-byte boundary)
    assert num_bytes == 16 + 128 + 7 * 4


def test_reused_buckets_deliver_each_sync_exactly():
    """Both sides reuse their buckets between syncs; every sync still delivers its own values."""
    syncs = [{"w": torch.randn(64, 8), "h": torch.randn(9).to(torch.bfloat16)} for _ in range(3)]
    metadata = weight_metadata(syncs[0].items())
    sender, receiver = _pair()
    got = []

    def receive():
        for _ in syncs:
            version, named = receiver.receive(metadata)
            got.append((version, {n: t.clone() for n, t in named}))  # load before the next receive

    thread = threading.Thread(target=receive)
    thread.start()
    for version, tensors in enumerate(syncs):
        sender.broadcast(tensors.items(), version)
    thread.join(10)
    sender.close()
    receiver.close()
    assert [v for v, _ in got] == [0, 1, 2]
    for (_, received), sent in zip(got, syncs, strict=True):
        assert all(torch.equal(received[n], t) for n, t in sent.items())


def test_absent_receiver_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not join"):
        WeightSender("127.0.0.1", free_port(), world_size=2, timeout_s=2, secret=SECRET).connect()
    assert time.monotonic() - start < 6


def test_dead_receiver_fails_broadcast_instead_of_hanging():
    sender, receiver = _pair(timeout_s=3)
    receiver.close()
    start = time.monotonic()
    with pytest.raises(WeightSyncError):
        sender.broadcast([("w", torch.ones(1000))], version=1)
    sender.close()
    assert time.monotonic() - start < 8


def _group(world_size: int, bucket_bytes: int, timeout_s: float = 20.0):
    port = free_port()
    sender = WeightSender(
        "127.0.0.1", port, world_size, timeout_s, bucket_bytes=bucket_bytes, secret=SECRET
    )
    receivers = [
        WeightReceiverGroup(
            "127.0.0.1", port, r, world_size, timeout_s, bucket_bytes=bucket_bytes, secret=SECRET
        )
        for r in range(1, world_size)
    ]
    joiners = [threading.Thread(target=r.connect) for r in receivers]
    for j in joiners:
        j.start()
    sender.connect()
    for j in joiners:
        j.join(timeout_s)
    return sender, receivers


def test_bucket_layout_splits_a_tensor_larger_than_a_bucket():
    metadata = weight_metadata(
        [
            ("a", torch.zeros(10)),
            ("b", torch.zeros(10)),
            ("big", torch.zeros(100)),  # 400 bytes: four buckets of 128
            ("c", torch.zeros(3)),
        ]
    )
    layout = bucket_layout(metadata, bucket_bytes=128)
    assert layout == [
        [Piece(0, 0, 40, 0), Piece(1, 0, 40, 64)],
        [Piece(2, 0, 128, 0)],
        [Piece(2, 128, 128, 0)],
        [Piece(2, 256, 128, 0)],
        [Piece(2, 384, 16, 0), Piece(3, 0, 12, 64)],
    ]
    whole = [Piece(0, 0, 40, 0), Piece(1, 0, 40, 64), Piece(2, 0, 400, 128), Piece(3, 0, 12, 576)]
    assert bucket_layout(metadata, bucket_bytes=1 << 20) == [whole]


@pytest.mark.parametrize("seed", range(20))
def test_bucket_layout_covers_every_byte_once_and_no_bucket_exceeds_the_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    bucket_bytes = int(torch.randint(64, 2048, (1,), generator=gen))
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
    tensors = [
        (f"t{i}", torch.zeros(int(n), dtype=dtypes[i % len(dtypes)]))
        for i, n in enumerate(torch.randint(0, 3000, (12,), generator=gen))
    ]
    metadata = weight_metadata(tensors)
    layout = bucket_layout(metadata, bucket_bytes)
    covered: dict[int, int] = {}  # tensor index -> bytes seen so far, in order
    for bucket in layout:
        assert bucket and bucket[-1].at + bucket[-1].length <= bucket_bytes
        end = 0
        for p in bucket:
            assert p.at % 64 == 0 and p.at >= end  # aligned, never overlapping
            end = p.at + p.length
            assert p.start == covered.get(p.index, 0)  # contiguous: each byte once, in order
            covered[p.index] = p.start + p.length
    assert covered == {i: t.numel() * t.element_size() for i, (_, t) in enumerate(tensors)}
    for i, (_, t) in enumerate(tensors):  # a tensor that fits a bucket travels whole
        pieces = [p for bucket in layout for p in bucket if p.index == i]
        assert len(pieces) == 1 or t.numel() * t.element_size() > bucket_bytes


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_any_group_size_delivers_bit_equal_tensors_in_bounded_buckets(world_size):
    """One broadcast reaches every receiver (several servers, or TP workers): all bit-equal, with
    no side holding more than one bucket beyond the weights, whatever the largest tensor."""
    tensors = [
        ("embed", torch.randn(300, 16)),  # 19200 bytes: larger than a bucket, split in pieces
        ("norm", torch.randn(16).to(torch.bfloat16)),
        *[(f"layer{i}", torch.randn(24, 16)) for i in range(6)],  # 1536 bytes each
    ]
    metadata = weight_metadata(tensors)
    bucket_bytes = 4096
    sender, receivers = _group(world_size, bucket_bytes)
    got: list[dict] = [{} for _ in receivers]

    def receive(i: int) -> None:
        for sync in range(2):
            version, named = receivers[i].receive(metadata)
            got[i][sync] = (version, dict(named))  # kept across buckets: copies, not views

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    sender.broadcast(tensors, version=1)
    second = [(n, t + 1) for n, t in tensors]
    sender.broadcast(second, version=2)
    for t in threads:
        t.join(30)
    for member in [sender, *receivers]:
        assert member.peak_bucket_bytes <= bucket_bytes
        member.close()
    for received in got:
        for sync, sent, version in ((0, tensors, 1), (1, second, 2)):
            v, named = received[sync]
            assert v == version and list(named) == [n for n, _ in sent]
            for name, t in sent:
                assert named[name].dtype == t.dtype and torch.equal(named[name], t)


def test_receivers_disagreeing_on_bucket_size_fail_loudly():
    tensors = [("w", torch.randn(64))]
    port = free_port()
    sender = WeightSender("127.0.0.1", port, 2, 3, bucket_bytes=1 << 20, secret=SECRET)
    receiver = WeightReceiverGroup("127.0.0.1", port, 1, 2, 3, bucket_bytes=64, secret=SECRET)
    metadata = weight_metadata(tensors) + weight_metadata([("x", torch.zeros(1))])
    joiner = threading.Thread(target=receiver.connect)
    joiner.start()
    sender.connect()
    joiner.join(10)
    errors = []

    def receive() -> None:
        try:
            receiver.receive(metadata)
        except WeightSyncError as err:
            errors.append(str(err))

    thread = threading.Thread(target=receive)
    thread.start()
    with pytest.raises(WeightSyncError):  # the receiver reads no bucket: the sender times out
        sender.broadcast(tensors, version=1)
    thread.join(10)
    sender.close()
    receiver.close()
    assert errors and "disagree" in errors[0]


def test_a_stranger_cannot_join_the_weight_group():
    """A process that reaches the store but lacks the run's secret is refused on both sides,
    before any collective; the trainer can then form the group with the real member."""
    port = free_port()
    sender = WeightSender("127.0.0.1", port, 2, 10.0, secret=SECRET)
    stranger = WeightReceiverGroup("127.0.0.1", port, 1, 2, 10.0, secret="a-guess")
    errors = {}

    def join():
        try:
            stranger.connect()
        except WeightSyncError as err:
            errors["stranger"] = str(err)

    thread = threading.Thread(target=join)
    thread.start()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="rank 1 does not know the run's secret; refused"):
        sender.connect()
    thread.join(10)
    assert time.monotonic() - start < 5
    assert "refused rank 1" in errors["stranger"] and not stranger.connected
    assert not sender.connected
    # The real member joins a new group on a new store, and receives the weights.
    real_sender, receiver = _pair()
    tensors = [("w", torch.arange(4.0))]
    got = {}
    thread = threading.Thread(
        target=lambda: got.update(receiver.receive(weight_metadata(tensors))[1])
    )
    thread.start()
    real_sender.broadcast(tensors, version=1)
    thread.join(10)
    assert torch.equal(got["w"], torch.arange(4.0))
    real_sender.close()
    receiver.close()


def test_a_member_without_a_secret_is_refused_at_once():
    with pytest.raises(ValueError, match="needs the run's secret"):
        WeightReceiverGroup("127.0.0.1", free_port(), 1, 2, 1.0, secret="")


def test_a_failed_collective_aborts_the_group_as_nccl_does():
    """gloo raises on a dead peer and would go on with the broken group; NCCL aborts its
    communicator. Both take NCCL's path: the group is aborted, every later call fails at once."""
    sender, receiver = _pair(timeout_s=3)
    receiver.close()
    with pytest.raises(WeightSyncError):
        sender.broadcast([("w", torch.ones(1000))], version=1)
    assert not sender.connected
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="aborted"):
        sender.broadcast([("w", torch.ones(1000))], version=2)
    assert time.monotonic() - start < 0.5
    sender.close()


class _HungGroup:
    """A process group whose graceful shutdown waits for a dead peer (NCCL's flush)."""

    def __init__(self, abort_hangs: bool = False):
        self.abort_hangs, self.aborted = abort_hangs, threading.Event()

    def shutdown(self) -> None:
        time.sleep(30)

    def abort(self) -> None:
        self.aborted.set()
        if self.abort_hangs:
            time.sleep(30)


@pytest.mark.parametrize("abort_hangs", [False, True])
def test_close_aborts_and_never_waits_for_a_dead_peer(monkeypatch, abort_hangs):
    monkeypatch.setattr(group_module, "CLOSE_TIMEOUT_S", 0.5)
    member = WeightReceiverGroup("127.0.0.1", free_port(), 1, 2, 30.0, secret=SECRET)
    member._group = _HungGroup(abort_hangs)
    done = threading.Event()
    threading.Thread(target=lambda: (member.close(), done.set()), daemon=True).start()
    assert done.wait(2), "close() waited for the dead peer"
    assert member._group is None and not member.connected


def test_the_nccl_group_is_built_to_raise_not_to_kill_the_process(monkeypatch):
    """torch's NCCL watchdog reads its error handling from the environment when the group is
    built; the default (3) kills the process on a timeout or a dead peer. Ours is built with 2
    (abort the communicator, raise), and the process's environment is left as it was."""
    import torch._C._distributed_c10d as c10d

    seen = {}

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world_size, options):
            seen["mode"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            seen["timeout"] = options._timeout

    monkeypatch.setattr(c10d, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    group_module._nccl_group(None, 0, 2, timedelta(seconds=7))
    assert seen == {"mode": "2", "timeout": timedelta(seconds=7)}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_gloo_binds_to_the_interface_that_reaches_the_trainer(monkeypatch):
    """Not torch's default device (the hostname's address, 127.0.1.1 on stock Ubuntu)."""
    asked = []
    real = group_module.gloo_device
    monkeypatch.setattr(group_module, "gloo_device", lambda host: asked.append(host) or real(host))
    sender, receiver = _pair()
    sender.close()
    receiver.close()
    assert asked == ["127.0.0.1", "127.0.0.1"]


@pytest.mark.parametrize("bucket_bytes", [4096, 1001])  # 1001: odd, splits mid-element
def test_received_in_place_a_split_tensor_lands_cast_to_its_destination(bucket_bytes):
    """``receive(into=...)`` (issue 42 item 10): tensors land in their destinations piece by
    piece, cast to the destination's dtype, are not yielded, and the others still are."""
    tensors = {
        "embed": torch.randn(300, 16).to(torch.bfloat16),  # 9600 bytes: split over buckets
        "norm": torch.randn(16),
        "head": torch.randn(200, 16),  # 12800 bytes: split, into a tensor of the same dtype
    }
    metadata = weight_metadata(tensors.items())
    layout = bucket_layout(metadata, bucket_bytes)
    for bucket in layout:  # every piece begins on a 64-byte boundary of its tensor
        assert all(p.start % 64 == 0 for p in bucket)
    sender, receiver = _pair()
    sender.bucket_bytes = receiver.bucket_bytes = bucket_bytes
    into = {"embed": torch.zeros(300, 16), "head": torch.zeros(200, 16)}  # embed: cast to fp32
    got = {}

    def receive():
        version, named = receiver.receive(metadata, into=into)
        got.update(named)

    thread = threading.Thread(target=receive)
    thread.start()
    sender.broadcast(tensors.items(), version=1)
    thread.join(10)
    with pytest.raises(ValueError, match="contiguous tensor of the sync's shape"):
        receiver.receive(metadata, into={"head": torch.zeros(16, 200).t()})
    sender.close()
    receiver.close()
    assert list(got) == ["norm"] and torch.equal(got["norm"], tensors["norm"])
    assert into["embed"].dtype == torch.float32
    assert torch.equal(into["embed"], tensors["embed"].float())
    assert torch.equal(into["head"], tensors["head"])
    assert len(layout) > 3
