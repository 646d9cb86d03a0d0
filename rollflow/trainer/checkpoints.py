"""Checkpoints and exports as every rank runs them: each rank writes and uploads its part.

Owns: where a checkpoint is staged (a folder of one name, broadcast by rank 0, in each rank's own
temp folder: nodes share no file system), who uploads which file (``assign_uploads``), the commit
(``checkpoints/step=N/_SUCCESS``, by rank 0 once every rank's upload is done), where a loaded one
is copied (``LOCAL_CHECKPOINTS`` of each host), and the HF exports and gradient dumps used for
inspection. Every command here is a collective with the control group's deadline.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import fsspec

from rollflow.infra.errors import StorageError
from rollflow.infra.storage import LOCAL_CHECKPOINTS, RunStorage
from rollflow.trainer.control import ControlGroup, pid_alive
from rollflow.trainer.protocol import ExportHF, Gradients, StepRef
from rollflow.trainer.rank_trainer import Trainer


def assign_uploads(listings: list[list[str]]) -> list[list[str]]:
    """Which rank uploads which staged file: each file by the first rank that sees it.

    ``listings[r]`` is the files rank ``r`` sees in its staging folder. Ranks of one node (or of
    nodes sharing a file system) see the same files, and the first of them uploads them; a node
    of its own uploads what its ranks wrote. Every file is uploaded exactly once.
    """
    taken: set[str] = set()
    assigned = []
    for files in listings:
        mine = [f for f in files if f not in taken]
        taken.update(mine)
        assigned.append(mine)
    return assigned


def staged_files(folder: Path) -> list[str]:
    """The files under ``folder``, as sorted POSIX paths relative to it."""
    return sorted(f.relative_to(folder).as_posix() for f in folder.rglob("*") if f.is_file())


def failures(outcomes: list[str | None]) -> str | None:
    """One line naming every rank whose part failed, or None when all succeeded."""
    failed = [f"rank {r}: {err}" for r, err in enumerate(outcomes) if err]
    return "; ".join(failed) or None


STAGING_PREFIX = "rollflow-ckpt-"


def _owner_file(folder: Path) -> Path:
    return folder.with_name(folder.name + ".pid")


def sweep_stale_staging(temp_dir: str | Path | None = None) -> list[Path]:
    """Remove the checkpoint staging folders of this host whose rank is gone (killed inside a
    save: a model's size each, on a GPU node's /tmp). A folder is its rank's while the process
    named in its ``.pid`` file lives; one without that file (from before it existed) is left.
    Returns the folders removed."""
    removed = []
    for owner in Path(temp_dir or tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*.pid"):
        try:
            pid = int(owner.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid_alive(pid):
            continue
        folder = owner.with_name(owner.name[: -len(".pid")])
        shutil.rmtree(folder, ignore_errors=True)
        owner.unlink(missing_ok=True)
        removed.append(folder)
    return removed


class CheckpointOps:
    """One rank's side of saving, loading and exporting the trainer's state."""

    def __init__(self, trainer: Trainer, control: ControlGroup, storage: RunStorage):
        self.trainer, self.control, self.storage = trainer, control, storage
        self.rank = control.rank
        sweep_stale_staging()

    def save_checkpoint(self, req: StepRef) -> dict:
        """Every rank writes its part into a staging folder on its own host and uploads what
        ``assign_uploads`` gives it; rank 0 commits once every upload is done."""
        start = time.perf_counter()
        name = None
        if self.rank == 0:
            self.storage.clear_uncommitted("checkpoints", req.step)
            name = f"{STAGING_PREFIX}{req.step}-{uuid.uuid4().hex[:12]}"
        folder = Path(tempfile.gettempdir()) / self.control.broadcast(name)
        folder.mkdir(parents=True, exist_ok=True)
        owner = _owner_file(folder)
        owner.write_text(str(os.getpid()))  # beside it: a rank killed mid-save leaves it swept
        try:
            self.trainer.save_checkpoint(folder)  # ends with a barrier: every part is written
            mine = assign_uploads(self.control.all_gather(staged_files(folder)))[self.rank]
            try:
                self.storage.upload_files(folder, mine, "checkpoints", req.step)
                outcome = None
            except Exception as err:  # every rank must reach the gather below
                outcome = f"{type(err).__name__}: {err}"
            failed = failures(self.control.all_gather(outcome))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            owner.unlink(missing_ok=True)
        if failed:
            raise StorageError(f"checkpoint {req.step} was not uploaded: {failed}")
        if self.rank != 0:
            return {}
        self.storage.commit("checkpoints", req.step)
        uri = self.storage.step_uri("checkpoints", req.step)
        return {"uri": uri, "checkpoint_s": time.perf_counter() - start}

    def load_checkpoint(self, req: StepRef) -> dict:
        """Every rank reads a copy on its own host (one download per host and checkpoint)."""
        try:
            folder, outcome = (
                self.storage.local_copy("checkpoints", req.step, LOCAL_CHECKPOINTS),
                None,
            )
        except Exception as err:  # every rank must reach the gather below
            folder, outcome = None, f"{type(err).__name__}: {err}"
        failed = failures(self.control.all_gather(outcome))
        if failed:
            raise StorageError(f"checkpoint {req.step} could not be read: {failed}")
        self.trainer.load_checkpoint(folder)
        return {"optim_step": self.trainer.step, "path": str(folder)}

    def export_hf(self, req: ExportHF) -> dict:
        """Weights, config and tokenizer as an HF directory at ``uri`` (a local path or fsspec URI)."""
        uri = req.uri
        fs, path = fsspec.core.url_to_fs(uri, **self.storage.options)
        local = "file" in fs.protocol
        # Rank 0 alone writes the export (on its host); a remote one is staged there first.
        staged = not local and self.rank == 0
        tmp = Path(tempfile.mkdtemp(prefix="rollflow-export-")) if staged else Path(path)
        try:
            self.trainer.export_hf(tmp)
            if staged:
                fs.put(f"{tmp}/", path, recursive=True)
        finally:
            if staged:
                shutil.rmtree(tmp, ignore_errors=True)
        return {"uri": uri}

    def gradients(self, req: Gradients) -> dict:
        """Save the accumulated full gradient (HF names) as safetensors at ``path`` (rank 0)."""
        from safetensors.torch import save_file

        grads = self.trainer.full_gradients()
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in grads.items()}, req.path)
        return {"path": req.path, "num_tensors": len(grads)}
