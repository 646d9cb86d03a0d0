"""A committed checkpoint as a plain Hugging Face model folder (``rollflow export``).

The folder holds what ``from_pretrained`` and vLLM load (config, safetensors, tokenizer), without
the checkpoint's ``trainer/`` sub-folder (optimizer and trainer state) or its ``_SUCCESS`` marker.
A LoRA run's checkpoint also holds ``adapter/`` (peft's format): by default its export is that
adapter alone, and with ``merged`` the merged model (the checkpoint's top level).
It is written next to its target and renamed into place, so a folder at ``out`` is always whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm import tqdm

from rollflow.infra.errors import InputError
from rollflow.infra.storage import SUCCESS, RunStorage

TRAINER_STATE = "trainer"
ADAPTER = "adapter"  # a LoRA checkpoint's sub-folder: the adapter alone (peft's format)
CHUNK_BYTES = 8 << 20


def export_checkpoint(
    storage: RunStorage,
    step: int,
    out: str | Path,
    show_progress: bool = True,
    merged: bool = False,
) -> Path:
    """Copy ``checkpoints/step=<step>`` of the run, less its trainer state, to the folder ``out``:
    the model, or for a LoRA run the adapter (the merged model with ``merged``)."""
    committed = storage.committed_steps("checkpoints")
    if step not in committed:
        listed = _ranges(committed) if committed else "none yet"
        raise InputError(
            f"run {storage.run!r} has no committed checkpoint of step {step} in "
            f"{storage.uri}/checkpoints; committed steps: {listed}"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(
            f"{out} already exists and is not an empty folder; pass another --out or remove it"
        )
    source = storage.step_dir("checkpoints", step)
    files = {
        path[len(source) + 1 :]: info["size"]
        for path, info in storage.fs.find(source, detail=True).items()
    }
    files = {
        rel: size
        for rel, size in sorted(files.items())
        if rel != SUCCESS and not rel.startswith(f"{TRAINER_STATE}/")
    }
    adapter = {rel: size for rel, size in files.items() if rel.startswith(f"{ADAPTER}/")}
    if adapter and not merged:
        files = {rel[len(ADAPTER) + 1 :]: size for rel, size in adapter.items()}
        source = f"{source}/{ADAPTER}"
    else:
        files = {rel: size for rel, size in files.items() if rel not in adapter}
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tqdm(
        total=sum(files.values()),
        unit="B",
        unit_scale=True,
        disable=not show_progress,
        desc=f"export step {step}",
    ) as bar:
        for rel, _ in files.items():
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with storage.fs.open(f"{source}/{rel}", "rb") as src, open(target, "wb") as dst:
                while chunk := src.read(CHUNK_BYTES):
                    dst.write(chunk)
                    bar.update(len(chunk))
    if out.exists():
        out.rmdir()  # empty, checked above
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(out)
    return out


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5': readable for runs of hundreds of steps."""
    parts = []
    start = prev = steps[0]
    for cur in [*steps[1:], None]:
        if cur is not None and cur == prev + 1:
            prev = cur
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        start = prev = cur
    return ", ".join(parts)
