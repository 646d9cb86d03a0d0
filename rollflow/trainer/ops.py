"""The trainer's commands as every rank runs them: read the batch, take this rank's share, compute.

Rank 0 broadcasts a command (small JSON, see ``service``); every rank then calls ``RankOps.run``
with it. A command runs in two phases:

1. prepare (local): read the batch's Parquet from storage, check it, plan and pack this rank's
   micro-batches. The ranks then exchange a status; if any rank found bad input, every rank
   raises ``InputError`` together, before any model collective, and the service stays usable.
2. compute (collective): forward / backward / step / gather, identical on every rank.

An exception in phase 2 leaves the ranks out of step: the service treats it as fatal.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rollflow.infra.errors import InputError, StorageError, WeightSyncError
from rollflow.infra.storage import RunStorage
from rollflow.infra.weights.group import WeightSender
from rollflow.trainer.control import ControlGroup
from rollflow.trainer.losses import ratio_quantiles
from rollflow.trainer.metrics import PerEnvMoments, effective_sample_size
from rollflow.trainer.packing import PackedBatch, Sequence, pack, plan_micro_batches
from rollflow.trainer.protocol import (
    BatchRef,
    Broadcast,
    ExportHF,
    ForwardBackward,
    Gradients,
    StepRef,
    WeightConnect,
)
from rollflow.trainer.trainer import SUM_KEYS, Trainer, add_counts

LOCAL_CHECKPOINTS = Path("~/.cache/rollflow/checkpoints").expanduser()
BATCH_COLUMNS = [
    "env",
    "group_index",
    "sample_index",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "advantage",
]
OPTIONAL_BATCH_COLUMNS = ["completion_mask"]  # absent in batches of older runs: all ones


class RankOps:
    """One rank's side of every command: ``run(op, args)`` parses ``args`` into the op's request
    model (``protocol.py``, the same the HTTP route parsed) and runs it."""

    def __init__(
        self,
        trainer: Trainer,
        control: ControlGroup,
        storage: RunStorage,
        *,
        micro_batch_tokens: int,
        row_tokens: int | None,
    ):
        self.trainer, self.control, self.storage = trainer, control, storage
        self.rank, self.world_size = control.rank, control.world_size
        self.micro_batch_tokens, self.row_tokens = micro_batch_tokens, row_tokens
        self.sender: WeightSender | None = None  # rank 0 only
        # Rank 0: the weights captured at the end of a step, sent later off the command loop
        # (``send_captured``), while the next step trains; the lock serialises sender use.
        self.captured: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.sender_lock = threading.Lock()
        self._cache: dict[tuple[str, int], pa.Table] = {}
        self._commands: dict[str, tuple[Any, type | None]] = {
            "ping": (lambda _: {}, None),
            "forward": (self.forward, BatchRef),
            "forward_backward": (self.forward_backward, ForwardBackward),
            "optim_step": (lambda _: self.optim_step(), None),
            "save_checkpoint": (self.save_checkpoint, StepRef),
            "load_checkpoint": (self.load_checkpoint, StepRef),
            "export_hf": (self.export_hf, ExportHF),
            "gradients": (self.gradients, Gradients),
            "weights_connect": (self.weights_connect, WeightConnect),
            "weights_capture": (self.weights_capture, Broadcast),
            "weights_broadcast": (self.weights_broadcast, Broadcast),
            "weights_close": (lambda _: self.weights_close(), None),
        }

    def run(self, op: str, args: dict[str, Any]) -> Any:
        handler, request = self._commands[op]
        return handler(request.model_validate(args) if request is not None else None)

    # ---------------------------------------------------------------------------- prepare

    def _agree(self, prepare) -> list[Any]:
        """Run ``prepare`` here, exchange outcomes; raise ``InputError`` on every rank if any failed."""
        try:
            mine = {"ok": prepare()}
        except (InputError, StorageError, ValueError, KeyError, OSError) as err:
            mine = {"error": f"rank {self.rank}: {err}"}
        everyone = self.control.all_gather(mine)
        errors = [o["error"] for o in everyone if "error" in o]
        if errors:
            raise InputError(errors[0])
        return [o["ok"] for o in everyone]

    def _table(self, kind: str, step: int) -> pa.Table:
        key = (kind, step)
        if key not in self._cache:
            if not self.storage.is_committed(kind, step):
                hint = " (call forward first)" if kind == "logprobs" else ""
                raise InputError(f"{self.storage.step_uri(kind, step)} is not committed{hint}")
            self._cache = {k: v for k, v in self._cache.items() if k[1] == step}  # keep one step
            self._cache[key] = self.storage.read_step_table(kind, step)
        return self._cache[key]

    def sequences(
        self,
        step: int,
        groups: list[int] | None,
        old_logprobs: bool,
        samples: list[tuple[int, int]] | None = None,
    ) -> list[Sequence]:
        """The rows of batch ``step`` (restricted to ``groups``, then to the (group, sample) keys
        ``samples``), checked, in storage order."""
        table = self._table("batches", step)
        missing = [c for c in BATCH_COLUMNS if c not in table.column_names]
        if missing:
            raise InputError(f"batch step={step} lacks columns {missing}")
        if groups is not None:
            table = table.filter(
                pc.is_in(table["group_index"], value_set=pa.array(groups, type=pa.int32()))
            )
            absent = sorted(set(groups) - set(table["group_index"].to_pylist()))
            if absent:
                raise InputError(f"batch step={step} has no rows for groups {absent}")
        optional = [c for c in OPTIONAL_BATCH_COLUMNS if c in table.column_names]
        rows = table.select(BATCH_COLUMNS + optional).to_pylist()
        if samples is not None:
            wanted = {tuple(k) for k in samples}
            rows = [r for r in rows if (r["group_index"], r["sample_index"]) in wanted]
            if len(rows) != len(wanted):
                have = {(r["group_index"], r["sample_index"]) for r in rows}
                raise InputError(
                    f"batch step={step} has no rows for samples {sorted(wanted - have)[:8]}"
                )
        if not rows:
            raise InputError(f"batch step={step} has no rows for groups {groups}")
        old = self._old_logprobs(step) if old_logprobs else {}
        seqs = []
        for i, r in enumerate(rows):
            key = (r["group_index"], r["sample_index"])
            _check_row(step, i, r, old.get(key) if old_logprobs else None, old_logprobs)
            seqs.append(
                Sequence(
                    list(r["prompt_ids"]),
                    list(r["completion_ids"]),
                    list(r["completion_logprobs"]),
                    float(r["advantage"]),
                    r["env"] or "",
                    key,
                    old.get(key),
                    _mask_or_none(r.get("completion_mask")),
                )
            )
        return seqs

    def _old_logprobs(self, step: int) -> dict[tuple[int, int], list[float]]:
        table = self._table("logprobs", step)
        return {
            (g, s): lp
            for g, s, lp in zip(
                table["group_index"].to_pylist(),
                table["sample_index"].to_pylist(),
                table["logprobs"].to_pylist(),
                strict=True,
            )
        }

    def my_micro_batches(self, seqs: list[Sequence]) -> list[PackedBatch]:
        plan = plan_micro_batches(
            [s.num_tokens for s in seqs], self.world_size, self.micro_batch_tokens
        )
        return [pack([seqs[i] for i in mb], self.row_tokens) for mb in plan[self.rank]]

    # ---------------------------------------------------------------------------- commands

    def forward(self, req: BatchRef) -> dict:
        """Trainer log-probs of the batch's completions, written to ``logprobs/step=N`` (rank 0)."""
        start = time.perf_counter()
        mbs: list[PackedBatch] = []
        self._agree(
            lambda: mbs.extend(
                self.my_micro_batches(
                    self.sequences(req.step, req.group_indices, old_logprobs=False)
                )
            )
        )
        mine = self.trainer.forward(mbs)
        everyone = self.control.all_gather([[list(k), lp] for k, lp in mine])
        if self.rank != 0:
            return {}
        rows = sorted((tuple(k), lp) for part in everyone for k, lp in part)
        table = pa.table(
            {
                "group_index": pa.array([k[0] for k, _ in rows], pa.int32()),
                "sample_index": pa.array([k[1] for k, _ in rows], pa.int32()),
                "logprobs": pa.array([lp for _, lp in rows], pa.list_(pa.float32())),
            }
        )
        self.storage.remove_step("logprobs", req.step)
        self._cache.pop(("logprobs", req.step), None)
        uri = self.storage.write_step_table("logprobs", req.step, table)
        return {"uri": uri, "num_sequences": len(rows), "forward_s": time.perf_counter() - start}

    def forward_backward(self, req: ForwardBackward) -> dict:
        start = time.perf_counter()
        mbs: list[PackedBatch] = []

        def prepare() -> int:
            seqs = self.sequences(
                req.step, req.group_indices, req.old_logprobs == "trainer", req.samples
            )
            mbs.extend(self.my_micro_batches(seqs))
            return sum(s.num_loss_tokens for mb in mbs for s in mb.sequences)

        # The global loss-token count: each rank's count, summed over ranks (the all-gather above
        # is the all-reduce).
        tokens = sum(self._agree(prepare))
        denominator = req.num_loss_tokens or tokens
        mine = self.trainer.forward_backward(mbs, req.loss, denominator)
        everyone = self.control.all_gather(mine)
        if self.rank != 0:
            return {}
        return _merge_forward_backward(everyone, denominator, time.perf_counter() - start)

    def optim_step(self) -> dict:
        try:
            return self.trainer.optim_step()
        except RuntimeError as err:  # the same on every rank: no gradients anywhere
            if "without forward_backward" in str(err):
                raise InputError(str(err)) from None
            raise

    def save_checkpoint(self, req: StepRef) -> dict:
        """Every rank writes its part into rank 0's temporary folder; rank 0 uploads and commits."""
        start = time.perf_counter()
        made = tempfile.mkdtemp(prefix=f"rollflow-ckpt-{req.step}-") if self.rank == 0 else None
        folder = Path(self.control.broadcast(made))
        self.trainer.save_checkpoint(folder)
        if self.rank != 0:
            return {}
        try:
            uri = self.storage.upload_dir(folder, "checkpoints", req.step)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {"uri": uri, "checkpoint_s": time.perf_counter() - start}

    def load_checkpoint(self, req: StepRef) -> dict:
        local = (
            self.storage.local_copy("checkpoints", req.step, LOCAL_CHECKPOINTS)
            if self.rank == 0
            else None
        )
        folder = self.control.broadcast(str(local) if local is not None else None)
        self.trainer.load_checkpoint(folder)
        return {"optim_step": self.trainer.step, "path": folder}

    def export_hf(self, req: ExportHF) -> dict:
        """Weights, config and tokenizer as an HF directory at ``uri`` (a local path or fsspec URI)."""
        uri = req.uri
        fs, path = fsspec.core.url_to_fs(uri, **self.storage.options)
        local = "file" in fs.protocol
        tmp = Path(path) if local else Path(tempfile.mkdtemp(prefix="rollflow-export-"))
        try:
            self.trainer.export_hf(tmp)
            if self.rank == 0 and not local:
                fs.put(f"{tmp}/", path, recursive=True)
        finally:
            if not local and self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        return {"uri": uri}

    def gradients(self, req: Gradients) -> dict:
        """Save the accumulated full gradient (HF names) as safetensors at ``path`` (rank 0)."""
        from safetensors.torch import save_file

        grads = self.trainer.full_gradients()
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in grads.items()}, req.path)
        return {"path": req.path, "num_tensors": len(grads)}

    def weights_capture(self, req: Broadcast) -> dict:
        """A collective: gather what a sync sends (``Trainer.sync_weights``); rank 0 keeps a copy
        tagged ``req.version`` that ``send_captured`` sends later, so that the trainer can go on
        meanwhile."""
        start = time.perf_counter()
        named = self.trainer.sync_weights()
        if self.rank != 0:
            return {}
        owned = self.trainer.detached(named)
        with self.sender_lock:
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
        with self.sender_lock:
            if self.captured is None or self.captured[0] != version:
                return None
            if self.sender is None:
                raise WeightSyncError("weight group not connected: call /weights/connect first")
            named = self.captured[1]
            try:
                num_bytes = self.sender.broadcast(named, version)
            except Exception as err:
                self.sender.close()
                self.sender = None
                raise WeightSyncError(f"weight broadcast v{version} failed: {err}") from err
            self.captured = None
        return {"bytes": num_bytes, "broadcast_s": time.perf_counter() - start, "captured": True}

    def weights_connect(self, req: WeightConnect) -> dict:
        if self.rank == 0:
            with self.sender_lock:
                if self.sender is not None:
                    self.sender.close()
                self.sender = None
            # The plan's wire: NCCL from this rank's GPU, or gloo from host memory.
            device = self.trainer.device if req.wire_device == "cuda" else "cpu"
            sender = WeightSender(
                req.host,
                req.port,
                req.world_size,
                req.timeout_s,
                device,
                req.bucket_bytes,
                secret=os.environ["ROLLFLOW_TOKEN"],  # the run's token: vLLM's key too
            )
            try:
                sender.connect()
            except Exception as err:
                raise WeightSyncError(str(err)) from err
            self.sender = sender
        return {"ok": True}

    def weights_broadcast(self, req: Broadcast) -> dict:
        start = time.perf_counter()
        named = self.trainer.sync_weights()  # a collective: every rank helps gather
        if self.rank != 0:
            return {}
        with self.sender_lock:
            if self.sender is None:
                raise WeightSyncError("weight group not connected: call /weights/connect first")
            try:
                num_bytes = self.sender.broadcast(named, req.version)
            except Exception as err:  # the group is broken now: a restarted server connects anew
                self.sender.close()
                self.sender = None
                raise WeightSyncError(f"weight broadcast v{req.version} failed: {err}") from err
        return {"bytes": num_bytes, "broadcast_s": time.perf_counter() - start}

    def weights_close(self) -> dict:
        with self.sender_lock:
            if self.sender is not None:
                self.sender.close()
                self.sender = None
        return {"ok": True}


def _check_row(step: int, i: int, r: dict, old: list[float] | None, want_old: bool) -> None:
    where = f"batch step={step} row {i} (group {r['group_index']}, sample {r['sample_index']})"
    if not r["prompt_ids"]:
        raise InputError(
            f"{where}: empty prompt_ids; every sequence needs at least one prompt token"
        )
    if not r["completion_ids"]:
        raise InputError(f"{where}: empty completion_ids; filter such rows in the advantage stage")
    if len(r["completion_logprobs"] or []) != len(r["completion_ids"]):
        raise InputError(
            f"{where}: {len(r['completion_logprobs'] or [])} completion_logprobs for "
            f"{len(r['completion_ids'])} completion_ids"
        )
    mask = r.get("completion_mask")
    if mask is not None and (len(mask) != len(r["completion_ids"]) or set(mask) - {0, 1}):
        raise InputError(
            f"{where}: completion_mask must hold one 0 or 1 per completion token "
            f"({len(mask)} values for {len(r['completion_ids'])} tokens)"
        )
    if r["advantage"] is None or not math.isfinite(r["advantage"]):
        raise InputError(f"{where}: advantage is {r['advantage']}; it must be a finite number")
    if want_old and (old is None or len(old) != len(r["completion_ids"])):
        raise InputError(
            f"{where}: no trainer log-probs of matching length in logprobs/step={step}; "
            "call forward on this batch first"
        )


def _mask_or_none(mask: list[int] | None) -> list[int] | None:
    """None for an all-ones mask (the common single-turn row): nothing to mask."""
    if mask is None or all(mask):
        return None
    return list(mask)


def _merge_forward_backward(parts: list[dict], denominator: float, elapsed_s: float) -> dict:
    sums = {k: sum(p["sums"][k] for p in parts) for k in SUM_KEYS}
    per_env = PerEnvMoments()
    hist: list[float] = []
    for p in parts:
        per_env.merge_json(p["per_env"])
        hist = add_counts(hist, p.get("is_hist") or [])
    n = max(sums["num_loss_tokens"], 1)
    q05, q50, q95 = ratio_quantiles(hist)
    return {
        "loss": sums["loss_sum"] / denominator,
        "pg_loss": sums["pg_loss_sum"] / denominator,
        "num_loss_tokens": int(sums["num_loss_tokens"]),
        "num_tokens": int(sums["num_tokens"]),
        "clip_fraction": sums["clipped_tokens"] / n,
        "entropy": sums["entropy_sum"] / n,
        "mismatch_kl": sums["mismatch_kl_sum"] / n,
        "kl": sums["kl_sum"] / n,
        "tis_weight": sums["tis_weight_sum"] / n,
        "is_masked_fraction": sums["is_masked_tokens"] / n,
        "is_ratio_q05": q05,
        "is_ratio_q50": q50,
        "is_ratio_q95": q95,
        "ess": effective_sample_size(sums["is_weight_sum"], sums["is_weight_sq_sum"], n),
        "per_env": per_env.to_json(),
        "forward_backward_s": elapsed_s,
    }
