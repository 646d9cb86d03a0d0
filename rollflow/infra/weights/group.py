"""The weight plane: one persistent process group from the trainer (rank 0) to inference workers.

The group is private: a ``TCPStore`` hosted by the trainer and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) built on it, never the default ``torch.distributed`` group, so it
lives beside vLLM's and the trainer's own groups. Collectives are called on the group object
itself, each with a timeout: a dead peer is an error after ``timeout_s``, never a hang.

Wire format of one sync (no pickling; both sides hold the same JSON metadata and bucket size):

1. a header, int64 ``[version, total_bytes]``;
2. the tensors' bytes in metadata order, packed into buckets of at most ``bucket_bytes`` (each
   tensor starts at a 64-byte boundary; a tensor larger than a bucket travels alone), one
   broadcast per bucket. ``bucket_layout`` computes the packing; both sides call it.

Extra memory is one bucket on each side, reused by every sync (a fresh CPU bucket per sync paid a
page fault per 4 KiB page: bench/weight_sync.py measured ~3x the broadcast itself), plus, on
the receiving side when a sync spans several buckets, a copy of the tensors vLLM has not yet
loaded: its layer-wise reload keeps each tensor until its layer is complete, so views into a
bucket the next broadcast overwrites would be wrong. dtypes travel as bytes: nothing is cast.

Backend and device come from the placement plan (``placement.choose_backend``): NCCL with
buckets in GPU memory when both sides are on GPUs, gloo with buckets in host memory otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroup, TCPStore

from rollflow.infra.errors import WeightSyncError

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_STORE_PREFIX = "rollflow/weights"


def weight_metadata(named_tensors: NamedTensors) -> list[dict[str, Any]]:
    """JSON-able description of the tensors one sync carries: name, shape, dtype (``"float32"``)."""
    return [
        {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in named_tensors
    ]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype in weight metadata: {name!r}")
    return dtype


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_ALIGN = 64
DEFAULT_BUCKET_BYTES = 256 << 20


def _nbytes(m: dict[str, Any]) -> int:
    return _numel(m["shape"]) * _dtype(m["dtype"]).itemsize


def bucket_layout(metadata: list[dict[str, Any]], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The buckets of one sync: for each, ``(metadata index, byte offset)`` of its tensors.

    Greedy in metadata order; a tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    used = 0
    for i, m in enumerate(metadata):
        size = _nbytes(m)
        offset = -(-used // _ALIGN) * _ALIGN
        if current and offset + size > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append((i, offset))
        used = offset + size
    if current:
        buckets.append(current)
    return buckets


def _bucket_size(metadata: list[dict[str, Any]], bucket: list[tuple[int, int]]) -> int:
    i, offset = bucket[-1]
    return offset + _nbytes(metadata[i])


class _WeightGroupMember:
    """One rank of the weight group. Rank 0 hosts the store and is the broadcast root."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: str | torch.device = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.host, self.port = host, int(port)
        self.rank, self.world_size = int(rank), int(world_size)
        self.timeout = timedelta(seconds=float(timeout_s))
        self.device = torch.device(device)
        self.bucket_bytes = int(bucket_bytes)
        self._store: TCPStore | None = None
        self._group: ProcessGroup | None = None
        self._buffer: torch.Tensor | None = None  # the bucket, reused by every sync

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(self) -> None:
        """Join the group; returns once every rank has joined, or raises after ``timeout_s``."""
        if self._group is not None:
            return
        try:
            self._store = TCPStore(
                self.host,
                self.port,
                self.world_size,
                is_master=self.rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            store = PrefixStore(_STORE_PREFIX, self._store)
            self._group = self._make_group(store)
            # Gloo connects lazily on some versions: one tiny collective proves the mesh is up.
            self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        except Exception as err:
            self.close()
            raise WeightSyncError(
                f"rank {self.rank}/{self.world_size} could not join the weight group at "
                f"{self.host}:{self.port} within {self.timeout.total_seconds():.0f} s: {err}"
            ) from err

    def _make_group(self, store: PrefixStore) -> Any:
        if self.device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            torch.cuda.set_device(self.device)
            options = ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return ProcessGroupNCCL(store, self.rank, self.world_size, options)
        from torch._C._distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(store, self.rank, self.world_size, options)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self._group is None:
            raise WeightSyncError("weight group is not connected; call connect() first")
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        work = self._group.broadcast([tensor], opts)
        try:
            work.wait(self.timeout)
        except Exception as err:
            raise WeightSyncError(
                f"weight broadcast failed on rank {self.rank} "
                f"(timeout {self.timeout.total_seconds():.0f} s): {err}"
            ) from err
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Leave the group and release the store (rank 0 stops hosting it)."""
        group, self._group = self._group, None
        if group is not None:
            shutdown = getattr(group, "shutdown", None) or getattr(group, "abort", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception as err:  # teardown must not mask the error that caused it
                    logger.debug("weight group shutdown failed: %s", err)
        self._store = None
        self._buffer = None

    def _bucket(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the reused bucket buffer (grown when a larger bucket comes)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    @property
    def peak_bucket_bytes(self) -> int:
        """Bytes of the bucket buffer this member holds (its extra memory for syncs)."""
        return 0 if self._buffer is None else self._buffer.numel()


class WeightSender(_WeightGroupMember):
    """Trainer side of the weight group (rank 0, the broadcast root).

    Invariant: one ``broadcast`` call delivers every tensor of ``named_tensors`` to every
    receiver, in metadata order, tagged with ``version``; or raises within ``timeout_s``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        device: str | torch.device = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(host, port, 0, world_size, timeout_s, device, bucket_bytes)

    @torch.no_grad()
    def broadcast(self, named_tensors: NamedTensors, version: int) -> int:
        """Send all tensors as policy ``version``; returns the number of bytes sent."""
        tensors = [t.detach() for _, t in named_tensors]
        metadata = weight_metadata((str(i), t) for i, t in enumerate(tensors))
        layout = bucket_layout(metadata, self.bucket_bytes)
        total = sum(_bucket_size(metadata, b) for b in layout)
        header = torch.tensor([int(version), total], dtype=torch.int64, device=self.device)
        self._broadcast(header)
        for bucket in layout:
            buffer = self._bucket(_bucket_size(metadata, bucket))
            for i, offset in bucket:
                flat = tensors[i].contiguous().reshape(-1).view(torch.uint8)
                buffer[offset : offset + flat.numel()].copy_(flat)
            self._broadcast(buffer)
        return total + header.numel() * header.element_size()


class WeightReceiverGroup(_WeightGroupMember):
    """Inference side of the weight group (rank >= 1).

    Invariant: ``receive`` yields only tensors whose total size matches the metadata the group
    was set up with, with the version the sender tagged them with.
    """

    @torch.no_grad()
    def receive(
        self, metadata: list[dict[str, Any]]
    ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Receive one sync; returns its version and its ``(name, tensor)`` pairs.

        The pairs arrive as the loader asks for them, one bucket at a time: exhaust the iterator
        (``load`` does) before the next ``receive``, or the group falls out of step. With one
        bucket they are views into it, valid until the next ``receive``; with several, copies.
        """
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        version, total = (int(x) for x in header.tolist())
        layout = bucket_layout(metadata, self.bucket_bytes)
        expected = sum(_bucket_size(metadata, b) for b in layout)
        if total != expected:
            raise WeightSyncError(
                f"sender announced {total} bytes, metadata and trainer.weight_bucket_mb describe "
                f"{expected}: trainer and inference disagree on the model or the bucket size"
            )
        return version, self._tensors(metadata, layout)

    def _tensors(
        self, metadata: list[dict[str, Any]], layout: list[list[tuple[int, int]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        copy = len(layout) > 1  # the next bucket overwrites this one's bytes
        for bucket in layout:
            buffer = self._bucket(_bucket_size(metadata, bucket))
            self._broadcast(buffer)
            for i, offset in bucket:
                m = metadata[i]
                view = (
                    buffer[offset : offset + _nbytes(m)].view(_dtype(m["dtype"])).view(m["shape"])
                )
                yield m["name"], view.clone() if copy else view
