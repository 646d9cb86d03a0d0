"""Checkpoints and exports as every rank runs them: each rank writes its part, rank 0 moves files.

Owns: where a checkpoint is staged (a temporary folder rank 0 makes and broadcasts; a loaded one
is copied to ``LOCAL_CHECKPOINTS`` by rank 0 first), the upload that commits it
(``checkpoints/step=N``), and the HF exports and gradient dumps used for inspection. Every
command here is a collective: the ranks gather shards together, rank 0 alone touches storage.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import fsspec

from rollflow.infra.storage import RunStorage
from rollflow.trainer.control import ControlGroup
from rollflow.trainer.protocol import ExportHF, Gradients, StepRef
from rollflow.trainer.trainer import Trainer

LOCAL_CHECKPOINTS = Path("~/.cache/rollflow/checkpoints").expanduser()


class CheckpointOps:
    """One rank's side of saving, loading and exporting the trainer's state."""

    def __init__(self, trainer: Trainer, control: ControlGroup, storage: RunStorage):
        self.trainer, self.control, self.storage = trainer, control, storage
        self.rank = control.rank

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
