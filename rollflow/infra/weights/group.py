"""The weight plane: one persistent process group from the trainer (rank 0) to inference workers.

The group is private: a ``TCPStore`` hosted by the trainer and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) built on it, never the default ``torch.distributed`` group, so it
lives beside vLLM's and the trainer's own groups. Collectives are called on the group object
itself, each with a timeout: a dead peer is an error after ``timeout_s``, never a hang.

Wire format of one sync (no pickling; both sides hold the same JSON metadata):

1. a header, int64 ``[version, total_numel]``;
2. one flat bucket per dtype, in order of first appearance in the metadata, each the
   concatenation of the flattened tensors of that dtype in metadata order.

Membership is proven before the group forms: rank 0 posts a random nonce in the store, every
other rank answers HMAC-SHA256(run secret, nonce and its rank), and rank 0 checks each answer
and posts its verdict; a member that does not know the secret is refused with an error on both
sides. The process group's own rendezvous keys then live under a prefix derived from the secret
and the nonce, so a process that can reach the store but lacks the secret cannot read or
overwrite them (a ``TCPStore`` has no way to list its keys) to take a member's place.

A float32 model (the CPU path) is thus exactly one bucket. A bf16 model with float32 norms on GPU
is two, and nothing is cast. Each bucket costs one extra copy of the weights on both sides; both
sides keep their buckets between syncs and reuse them: a fresh CPU bucket per sync paid a page
fault per 4 KiB page on every sync (bench/weight_sync.py: ~3x the broadcast itself), and a
sync needs that memory anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroup, TCPStore

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.faults import fault_point

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


def _bucket_layout(metadata: list[dict[str, Any]]) -> dict[str, int]:
    """Number of elements of each dtype's bucket, in wire order."""
    layout: dict[str, int] = {}
    for m in metadata:
        layout[m["dtype"]] = layout.get(m["dtype"], 0) + _numel(m["shape"])
    return layout


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
        *,
        secret: str,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        if not secret:
            raise ValueError("the weight group needs the run's secret")
        self._secret = secret.encode()
        self.host, self.port = host, int(port)
        self.rank, self.world_size = int(rank), int(world_size)
        self.timeout = timedelta(seconds=float(timeout_s))
        self.device = torch.device(device)
        self._store: TCPStore | None = None
        self._group: ProcessGroup | None = None
        self._buckets: dict[str, torch.Tensor] = {}  # by dtype name, reused by every sync

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
            store = PrefixStore(self._authenticate(), self._store)
            self._group = self._make_group(store)
            # Gloo connects lazily on some versions: one tiny collective proves the mesh is up.
            self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        except _Refused as err:
            self.close()
            raise WeightSyncError(str(err)) from None
        except Exception as err:
            self.close()
            raise WeightSyncError(
                f"rank {self.rank}/{self.world_size} could not join the weight group at "
                f"{self.host}:{self.port} within {self.timeout.total_seconds():.0f} s: {err}"
            ) from err

    def _proof(self, nonce: bytes, label: str) -> bytes:
        return hmac.new(self._secret, nonce + b"|" + label.encode(), hashlib.sha256).digest()

    def _authenticate(self) -> str:
        """The challenge (see the module docstring); returns the group's secret store prefix."""
        auth = PrefixStore(f"{_STORE_PREFIX}/auth", self._store)
        if self.rank == 0:
            nonce = secrets.token_bytes(16)
            auth.set("nonce", nonce)
            for rank in range(1, self.world_size):
                answer = auth.get(f"proof/{rank}")  # waits, up to the store's timeout
                if not hmac.compare_digest(answer, self._proof(nonce, f"member {rank}")):
                    auth.set("verdict", f"rank {rank} refused")
                    with contextlib.suppress(Exception):  # let it read why, then close the store
                        auth.wait([f"seen/{rank}"], timedelta(seconds=2))
                    raise _Refused(
                        f"weight group at {self.host}:{self.port}: the process joining as rank "
                        f"{rank} does not know the run's secret; refused (another process on "
                        "this host tried to join the weight group)"
                    )
            auth.set("verdict", "ok")
        else:
            nonce = auth.get("nonce")
            auth.set(f"proof/{self.rank}", self._proof(nonce, f"member {self.rank}"))
            verdict = auth.get("verdict").decode()
            auth.set(f"seen/{self.rank}", b"1")
            if verdict != "ok":
                raise _Refused(
                    f"weight group at {self.host}:{self.port} refused rank {self.rank} "
                    f"({verdict}): it holds another secret than the trainer's; are the trainer "
                    "and vLLM of the same run?"
                )
        return f"{_STORE_PREFIX}/{self._proof(nonce, 'group').hex()[:32]}"

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
        self._buckets = {}

    def _bucket(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This dtype's bucket of ``numel`` elements: the previous sync's when it fits."""
        name = str(dtype).removeprefix("torch.")
        bucket = self._buckets.get(name)
        if bucket is None or bucket.numel() != numel:
            bucket = self._buckets[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return bucket


class _Refused(Exception):
    """A member failed (or was told it failed) the membership challenge."""


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
        *,
        secret: str,
    ) -> None:
        super().__init__(host, port, 0, world_size, timeout_s, device, secret=secret)

    @torch.no_grad()
    def broadcast(self, named_tensors: NamedTensors, version: int) -> int:
        """Send all tensors as policy ``version``; returns the number of bytes sent."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        total_numel = 0
        for _, t in named_tensors:
            by_dtype.setdefault(t.dtype, []).append(t.detach().reshape(-1))
            total_numel += t.numel()
        header = torch.tensor([int(version), total_numel], dtype=torch.int64, device=self.device)
        self._broadcast(header)
        fault_point("weight_broadcast")
        num_bytes = header.numel() * header.element_size()
        for dtype, flats in by_dtype.items():
            bucket = self._bucket(dtype, sum(f.numel() for f in flats))
            torch.cat([f.to(self.device) for f in flats], out=bucket)
            self._broadcast(bucket)
            num_bytes += bucket.numel() * bucket.element_size()
        return num_bytes


class WeightReceiverGroup(_WeightGroupMember):
    """Inference side of the weight group (rank >= 1).

    Invariant: ``receive`` returns only tensors whose total size matches the metadata the group
    was set up with, with the version the sender tagged them with.
    """

    @torch.no_grad()
    def receive(
        self, metadata: list[dict[str, Any]]
    ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Receive one sync; returns its version and ``(name, tensor)`` views into the buckets.

        The views are valid until the next ``receive``, which reuses the buckets: load them first.
        """
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        version, total_numel = (int(x) for x in header.tolist())
        layout = _bucket_layout(metadata)
        if total_numel != sum(layout.values()):
            raise WeightSyncError(
                f"sender announced {total_numel} elements, metadata describes "
                f"{sum(layout.values())}: trainer and inference disagree on the model"
            )
        buckets = {}
        for dtype_name, numel in layout.items():
            buckets[dtype_name] = self._bucket(_dtype(dtype_name), numel)
            self._broadcast(buckets[dtype_name])
        return version, _unflatten(metadata, buckets)


def _unflatten(
    metadata: list[dict[str, Any]], buckets: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    offsets = dict.fromkeys(buckets, 0)
    for m in metadata:
        n, start = _numel(m["shape"]), offsets[m["dtype"]]
        offsets[m["dtype"]] = start + n
        yield m["name"], buckets[m["dtype"]][start : start + n].view(m["shape"])
