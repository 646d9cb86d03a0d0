"""The weight group alone (no server): a sender and a receiver in one process, over gloo."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.service import free_port
from rollflow.infra.weights.group import WeightReceiverGroup, WeightSender, weight_metadata

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
    assert num_bytes == 16 + (12 + 7) * 4 + 5 * 2


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
