"""The weight group on NCCL: failures raise (never kill the process) and buffers stay bounded.

Without CUDA every test skips with its reason; the fault test needs two GPUs (NCCL refuses two
members of one group on one GPU). The same paths run on gloo in
tests/integration/infra/test_weight_group_peers.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible here)"),
]

BUCKET = 1 << 20
SECRET = "gpu"


def test_an_nccl_group_splits_a_large_tensor_and_closes_at_once():
    """A group of one on the GPU: built with CleanUpOnly (the process's environment untouched),
    a tensor 3x the bucket through a 1 MiB bucket, and close() aborting the communicator."""
    from rollflow.infra.processes import free_port
    from rollflow.infra.weights.group import WeightSender

    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    sender = WeightSender(
        "127.0.0.1", free_port(), 1, 30, device="cuda:0", bucket_bytes=BUCKET, secret=SECRET
    )
    sender.connect()
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before
    embed = torch.randn(3 * BUCKET // 2 + 7, device="cuda").to(torch.bfloat16)  # 3 MiB + 14 B
    sent = sender.broadcast([("embed", embed), ("norm", torch.ones(5, device="cuda"))], 1)
    assert sent >= embed.numel() * 2 and sender.peak_bucket_bytes <= BUCKET
    start = time.monotonic()
    sender.close()
    assert time.monotonic() - start < 5 and not sender.connected


def _doomed_receiver(port: int, metadata) -> None:
    from rollflow.infra.weights.group import WeightReceiverGroup

    group = WeightReceiverGroup(
        "127.0.0.1", port, 1, 2, 60, device="cuda:1", bucket_bytes=BUCKET, secret=SECRET
    )
    group.connect()
    _, named = group.receive(metadata)
    next(iter(named))  # mid-sync: one tensor in, the rest still on the wire
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_receiver_killed_mid_broadcast_raises_on_nccl_and_rank_0_lives():
    """torch's default NCCL error handling would take this process down here."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL: one rank per GPU)")
    from rollflow.infra.errors import WeightSyncError
    from rollflow.infra.processes import free_port
    from rollflow.infra.weights.group import WeightSender, weight_metadata

    tensors = [(f"w{i}", torch.randn(BUCKET // 4, device="cuda:0")) for i in range(8)]
    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_doomed_receiver, args=(port, weight_metadata(tensors)))
    proc.start()
    sender = WeightSender("127.0.0.1", port, 2, 10, "cuda:0", BUCKET, secret=SECRET)
    try:
        sender.connect()
        start = time.monotonic()
        with pytest.raises(WeightSyncError):
            for version in range(1, 5):
                sender.broadcast(tensors, version)
        assert time.monotonic() - start < 30 and not sender.connected
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 15
    finally:
        proc.kill()
        proc.join(10)
