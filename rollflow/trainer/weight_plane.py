"""The trainer's side of the weight plane: gather the weights on every rank, send them from rank 0.

Owns: rank 0's ``WeightSender`` (the weight group with the inference servers) and the weights
captured at the end of a step for a later send. Invariants: the sender is used only under
``lock`` (a send from an HTTP thread and a command never interleave); a failed send closes the
group (a restarted server connects anew) and raises ``WeightSyncError``, which leaves the ranks
in step; a capture is sent at most once, then dropped.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.weights.group import WeightSender
from rollflow.trainer.control import ControlGroup
from rollflow.trainer.protocol import TOKEN_ENV, WEIGHTS_CONNECT, Broadcast, WeightConnect
from rollflow.trainer.rank_trainer import Trainer

NOT_CONNECTED = f"weight group not connected: call {WEIGHTS_CONNECT.path} first"


class WeightPlane:
    """One rank's side of the weight commands; rank 0 alone holds the sender."""

    def __init__(self, trainer: Trainer, control: ControlGroup):
        self.trainer, self.rank = trainer, control.rank
        self.sender: WeightSender | None = None  # rank 0 only
        # Rank 0: the weights captured at the end of a step, sent later off the command loop
        # (``send_captured``), while the next step trains.
        self.captured: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self.sender is not None

    def connect(self, req: WeightConnect) -> dict:
        if self.rank == 0:
            self.close()
            # The plan's wire: NCCL from this rank's GPU, or gloo from host memory.
            device = self.trainer.device if req.wire_device == "cuda" else "cpu"
            sender = WeightSender(
                req.host,
                req.port,
                req.world_size,
                req.timeout_s,
                device,
                req.bucket_bytes,
                secret=os.environ[TOKEN_ENV],  # the run's token: vLLM's key too
            )
            try:
                sender.connect()
            except Exception as err:
                raise WeightSyncError(str(err)) from err
            self.sender = sender
        return {"ok": True}

    def capture(self, req: Broadcast) -> dict:
        """A collective: gather what a sync sends (``Trainer.sync_weights``); rank 0 keeps a copy
        tagged ``req.version`` that ``send_captured`` sends later, so that the trainer can go on
        meanwhile."""
        start = time.perf_counter()
        named = self.trainer.sync_weights()
        if self.rank != 0:
            return {}
        owned = self.trainer.detached(named)
        with self.lock:
            self.captured = (req.version, owned)
        return {
            "version": req.version,
            "capture_s": time.perf_counter() - start,
            "bytes": sum(t.numel() * t.element_size() for _, t in owned),
        }

    def send_captured(self, version: int) -> dict | None:
        """Rank 0, on an HTTP worker thread (not the command loop): broadcast the weights captured
        as ``version`` and drop them. None when no capture of that version is held."""
        start = time.perf_counter()
        with self.lock:
            if self.captured is None or self.captured[0] != version:
                return None
            num_bytes = self._send(self.captured[1], version)
            self.captured = None
        return {"bytes": num_bytes, "broadcast_s": time.perf_counter() - start, "captured": True}

    def broadcast(self, req: Broadcast) -> dict:
        start = time.perf_counter()
        named = self.trainer.sync_weights()  # a collective: every rank helps gather
        if self.rank != 0:
            return {}
        with self.lock:
            num_bytes = self._send(named, req.version)
        return {"bytes": num_bytes, "broadcast_s": time.perf_counter() - start}

    def _send(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> int:
        """Under ``lock``: send ``named`` as ``version``; a failure closes the group."""
        if self.sender is None:
            raise WeightSyncError(NOT_CONNECTED)
        try:
            return self.sender.broadcast(named, version)
        except Exception as err:  # the group is broken now: a restarted server connects anew
            self.sender.close()
            self.sender = None
            raise WeightSyncError(f"weight broadcast v{version} failed: {err}") from err

    def close(self, _: None = None) -> dict:
        with self.lock:
            if self.sender is not None:
                self.sender.close()
                self.sender = None
        return {"ok": True}
