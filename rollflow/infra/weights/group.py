"""The weight plane: one persistent process group from the trainer (rank 0) to inference workers.

The group is private: a ``TCPStore`` hosted by the trainer and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) built on it, never the default ``torch.distributed`` group, so it
lives beside vLLM's and the trainer's own groups. Collectives are called on the group object
itself, each with a timeout: a dead peer is an error after ``timeout_s``, never a hang.

Wire format of one sync (no pickling; both sides hold the same JSON metadata and bucket size):

1. a header, int64 ``[version, total_bytes]``;
2. the tensors' bytes in metadata order, packed into buckets of at most ``bucket_bytes``, one
   broadcast per bucket. Each piece starts at a 64-byte boundary of its bucket; a tensor that
   fits a bucket travels whole (in the next bucket if the current one is too full); a larger
   one fills the current bucket's rest and goes on in the next buckets, in pieces
   (``Piece(index, start, length, at)``: bytes ``[start, start + length)`` of tensor ``index``
   at byte ``at`` of its bucket; every piece of a split tensor but its last is a multiple of 64
   bytes, so each piece begins on an element). ``bucket_layout`` computes the pieces; both sides
   call it.

Extra memory is one bucket of at most ``bucket_bytes`` on each side, whatever the largest tensor
(an embedding of 152k x 3584 no longer sizes a buffer outside vLLM's memory budget), reused by
every sync (a fresh CPU bucket per sync paid a page fault per 4 KiB page: bench/weight_sync.py
measured ~3x the broadcast itself). On the receiving side, a tensor given a destination
(``receive(into=...)``: a load that is a plain copy) goes from the bucket straight into it, piece
by piece, cast to its dtype: nothing more. A tensor the loader takes whole (vLLM's
``load_weights``: its loaders narrow a tensor to a TP shard, stack q/k/v and gate/up, and its
layer-wise reload keeps each tensor until its layer is complete) costs, when a sync spans several
buckets, a copy of it until it is loaded (a view into a bucket the next broadcast overwrites
would be wrong); a split one is assembled in host memory, never on the wire's GPU, as a
checkpoint's tensors are before vLLM's loader copies them to the device. dtypes travel as bytes:
only a destination casts.

Backend and device come from the placement plan (``placement.choose_backend``): NCCL with
buckets in GPU memory when both sides are on GPUs, gloo with buckets in host memory otherwise.

Failures take one path on both backends, NCCL's: any collective that fails or outlives
``timeout_s`` aborts the group (``abort()``: the communicator is gone, every later call raises
at once) and raises ``WeightSyncError``; the owner closes the member and connects anew. torch's
own NCCL watchdog would instead take the whole process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
defaults to 3, "SkipCleanUp": tear down without cleanup) on a timeout or a dead peer, killing
trainer rank 0 when a vLLM server dies mid-sync; the NCCL group is therefore built with mode 2,
"CleanUpOnly" (abort the communicators, never the process), so ``work.wait`` raises instead.
gloo raises by itself and would go on with a broken group: here it is aborted just the same.
``close()`` aborts rather than shuts down (NCCL's ``shutdown`` flushes, waiting for peers that
may be dead) and gives up waiting after ``CLOSE_TIMEOUT_S``.

Membership is proven before the group forms: rank 0 posts a random nonce in the store, every
other rank answers HMAC-SHA256(run secret, nonce and its rank), and rank 0 checks each answer
and posts its verdict; a member that does not know the secret is refused with an error on both
sides. The process group's own rendezvous keys then live under a prefix derived from the secret
and the nonce, so a process that can reach the store but lacks the secret cannot read or
overwrite them (a ``TCPStore`` has no way to list its keys) to take a member's place.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroup, TCPStore

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.faults import fault_point
from rollflow.infra.network import gloo_device

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


def metadata_bytes(metadata: list[dict[str, Any]]) -> int:
    """The tensor bytes a sync described by ``metadata`` carries (no header, no alignment)."""
    return sum(_nbytes(m) for m in metadata)


class Piece(NamedTuple):
    """Bytes ``[start, start + length)`` of tensor ``index`` travel at byte ``at`` of a bucket."""

    index: int
    start: int
    length: int
    at: int


def bucket_layout(metadata: list[dict[str, Any]], bucket_bytes: int) -> list[list[Piece]]:
    """The buckets of one sync, each the pieces it carries; no bucket exceeds ``bucket_bytes``.

    Greedy in metadata order: a tensor that fits a bucket is never split; a larger one fills the
    current bucket and continues in as many buckets as it needs.
    """
    if bucket_bytes < _ALIGN:
        raise ValueError(f"bucket_bytes must be at least {_ALIGN}, got {bucket_bytes}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for i, m in enumerate(metadata):
        size, start = _nbytes(m), 0
        while True:
            at = -(-used // _ALIGN) * _ALIGN
            room = bucket_bytes - at
            if current and (room <= 0 or (size - start <= bucket_bytes and size - start > room)):
                buckets.append(current)
                current, at, room = [], 0, bucket_bytes
            length = min(size - start, room)
            if length < size - start:  # a split: end the piece on a multiple of 64 bytes
                length -= length % _ALIGN
                if length == 0:
                    buckets.append(current)
                    current, used = [], 0
                    continue
            current.append(Piece(i, start, length, at))
            used, start = at + length, start + length
            if start >= size:
                break
    if current:
        buckets.append(current)
    return buckets


def _bucket_size(bucket: list[Piece]) -> int:
    return bucket[-1].at + bucket[-1].length


CLOSE_TIMEOUT_S = 10.0
# torch's ErrorHandlingMode 2, "CleanUpOnly": on an error or a timeout the NCCL watchdog aborts
# the communicators and the waiting call raises; the default (3) takes the process down.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_ENV_LOCK = threading.Lock()


def _nccl_group(store: PrefixStore, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ``ProcessGroupNCCL`` whose failures raise: its error handling is read from the
    environment when it is built, so the environment says CleanUpOnly for that moment only."""
    from torch._C._distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in NCCL_ERROR_HANDLING}
        os.environ.update(NCCL_ERROR_HANDLING)
        try:
            return ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _bounded(call: Any, what: str, timeout_s: float) -> None:
    """Run ``call`` on a thread and wait at most ``timeout_s``: teardown must neither hang nor
    mask the error that caused it."""

    def run() -> None:
        try:
            call()
        except Exception as err:
            logger.debug("weight group %s failed: %s", what, err)

    thread = threading.Thread(target=run, name=f"weight-group-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("weight group %s did not finish within %.0f s; left behind", what, timeout_s)


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
        self.bucket_bytes = int(bucket_bytes)
        self._store: TCPStore | None = None
        self._group: ProcessGroup | None = None
        self._buffer: torch.Tensor | None = None  # the bucket, reused by every sync
        self._failure: str | None = None  # why the group was aborted, until close()

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(self) -> None:
        """Join the group; returns once every rank has joined, or raises after ``timeout_s``."""
        if self._group is not None:
            return
        self._failure = None
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
            torch.cuda.set_device(self.device)
            return _nccl_group(store, self.rank, self.world_size, self.timeout)
        return self._gloo_group(store)

    def _gloo_group(self, store: PrefixStore) -> Any:
        """gloo, which also takes CUDA tensors (staged through host memory)."""
        from torch._C._distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = self.timeout
        # The interface that reaches the store's host, not the hostname's (maybe 127.0.1.1).
        options._devices = [gloo_device(self.host)]
        return ProcessGroupGloo(store, self.rank, self.world_size, options)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """One collective, through the failure path both backends share (module docstring)."""
        if self._group is None:
            raise WeightSyncError(
                self._failure or "weight group is not connected; call connect() first"
            )
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        try:
            work = self._group.broadcast([tensor], opts)
            work.wait(self.timeout)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as err:
            raise self._abort(
                f"weight broadcast failed on rank {self.rank} "
                f"(timeout {self.timeout.total_seconds():.0f} s): {err}"
            ) from err

    def _abort(self, reason: str) -> WeightSyncError:
        """Abort the group as NCCL does on an error: it is unusable from now on, on any backend.

        Returns the error to raise; later collectives raise it at once, without touching a peer.
        """
        group, self._group = self._group, None
        self._failure = f"weight group aborted: {reason}; close it and connect anew"
        if group is not None:
            _bounded(group.abort, "abort", CLOSE_TIMEOUT_S)
        return WeightSyncError(reason)

    def close(self) -> None:
        """Leave the group and release the store (rank 0 stops hosting it); never hangs.

        Aborts the communicator: a graceful shutdown would wait for the peers (on NCCL it
        flushes), and a peer may be dead. Gives up after ``CLOSE_TIMEOUT_S``.
        """
        group, self._group = self._group, None
        if group is not None:
            _bounded(group.abort, "abort", CLOSE_TIMEOUT_S)
        self._store = None
        self._buffer = None
        self._failure = None

    def _bucket(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the reused bucket buffer (grown when a larger bucket comes)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    @property
    def peak_bucket_bytes(self) -> int:
        """Bytes of the bucket buffer this member holds (its extra memory for syncs)."""
        return 0 if self._buffer is None else self._buffer.numel()


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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        secret: str,
    ) -> None:
        super().__init__(host, port, 0, world_size, timeout_s, device, bucket_bytes, secret=secret)

    @torch.no_grad()
    def broadcast(self, named_tensors: NamedTensors, version: int) -> int:
        """Send all tensors as policy ``version``; returns the number of bytes sent."""
        tensors = [t.detach() for _, t in named_tensors]
        metadata = weight_metadata((str(i), t) for i, t in enumerate(tensors))
        layout = bucket_layout(metadata, self.bucket_bytes)
        total = sum(_bucket_size(b) for b in layout)
        header = torch.tensor([int(version), total], dtype=torch.int64, device=self.device)
        self._broadcast(header)
        fault_point("weight_broadcast")
        flat: dict[int, torch.Tensor] = {}  # the tensor whose pieces are being sent, as bytes
        for bucket in layout:
            buffer = self._bucket(_bucket_size(bucket))
            for p in bucket:
                if p.index not in flat:
                    flat = {p.index: tensors[p.index].contiguous().reshape(-1).view(torch.uint8)}
                src = flat[p.index][p.start : p.start + p.length]
                buffer[p.at : p.at + p.length].copy_(src)
            self._broadcast(buffer)
        return total + header.numel() * header.element_size()


class WeightReceiverGroup(_WeightGroupMember):
    """Inference side of the weight group (rank >= 1).

    Invariant: ``receive`` yields only tensors whose total size matches the metadata the group
    was set up with, with the version the sender tagged them with.
    """

    @torch.no_grad()
    def receive(
        self, metadata: list[dict[str, Any]], into: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Receive one sync; returns its version and its ``(name, tensor)`` pairs.

        The pairs arrive as the loader asks for them, one bucket at a time: exhaust the iterator
        (``load`` does) before the next ``receive``, or the group falls out of step. With one
        bucket they are views into it, valid until the next ``receive``; with several, copies;
        a tensor split over buckets is assembled in host memory. A tensor named in ``into`` is
        received into that tensor instead (contiguous, its shape, cast to its dtype), through
        the bucket and nothing more, and is not yielded.
        """
        into = dict(into or {})
        shapes = {m["name"]: m["shape"] for m in metadata}
        for name, dest in into.items():
            if list(dest.shape) != shapes.get(name) or not dest.is_contiguous():
                raise ValueError(
                    f"receive into {name!r}: a contiguous tensor of the sync's shape "
                    f"{shapes.get(name)} is needed, got {tuple(dest.shape)}"
                )
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        version, total = (int(x) for x in header.tolist())
        layout = bucket_layout(metadata, self.bucket_bytes)
        expected = sum(_bucket_size(b) for b in layout)
        if total != expected:
            raise WeightSyncError(
                f"sender announced {total} bytes, metadata and trainer.weight_bucket_mb describe "
                f"{expected}: trainer and inference disagree on the model or the bucket size"
            )
        return version, self._tensors(metadata, layout, into)

    def _tensors(
        self, metadata: list[dict[str, Any]], layout: list[list[Piece]], into: dict
    ) -> Iterator[tuple[str, torch.Tensor]]:
        copy = len(layout) > 1  # the next bucket overwrites this one's bytes
        whole: torch.Tensor | None = None  # a split tensor, assembled in host memory
        for bucket in layout:
            buffer = self._bucket(_bucket_size(bucket))
            self._broadcast(buffer)
            for p in bucket:
                m = metadata[p.index]
                size = _nbytes(m)
                piece = buffer[p.at : p.at + p.length]
                if m["name"] in into:
                    _copy_piece(into[m["name"]], p.start, piece, _dtype(m["dtype"]))
                    continue
                if p.length == size:  # whole in this bucket
                    data = piece.clone() if copy else piece
                else:
                    if p.start == 0:
                        whole = torch.empty(size, dtype=torch.uint8)
                    assert whole is not None
                    whole[p.start : p.start + p.length].copy_(piece)
                    if p.start + p.length < size:
                        continue
                    data, whole = whole, None
                yield m["name"], data.view(_dtype(m["dtype"])).view(m["shape"])


def _copy_piece(dest: torch.Tensor, start: int, piece: torch.Tensor, dtype: torch.dtype) -> None:
    """Bytes ``[start, start + len(piece))`` of a ``dtype`` tensor into ``dest`` (contiguous, its
    dtype); pieces begin on an element (``bucket_layout``)."""
    if dest.dtype == dtype:
        dest.view(-1).view(torch.uint8)[start : start + piece.numel()].copy_(piece)
    else:
        values = piece.view(dtype)
        first = start // dtype.itemsize
        dest.view(-1)[first : first + values.numel()].copy_(values)
