"""An adapter-only sync's files on a vLLM server (``train.lora.sync = "adapter"``).

vLLM serves the policy as a LoRA adapter (``--lora-modules policy=<initial adapter>``) and reads a
new adapter only from a folder in peft's format. The server owns a local root folder (named in
its environment, ``inference/protocol.LORA_ROOT_ENV``): ``prepare_root`` puts the initial
adapter's ``adapter_config.json`` there (rank, alpha and target modules do not change during a
run), and the worker extension writes each received version as ``<root>/v<version>-w<worker>/``
with ``write_version``. Nothing crosses nodes: the tensors arrive over the weight group.

Invariant: after ``write_version`` returns, its folder holds exactly the received tensors beside
the config, and it is the only version folder of that worker left under the root.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def prepare_root(root: str | Path, initial_adapter: str | Path) -> Path:
    """Create ``root`` (empty) holding the config every version shares."""
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copy(Path(initial_adapter) / CONFIG, root / CONFIG)
    return root


def write_version(
    root: str | Path, version: int, worker: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Path:
    """Write one received adapter (peft's names) as a peft folder; drop the worker's older ones.

    A new folder per version, written under a temporary name and renamed: a reader never sees a
    half-written adapter. Each worker of a tensor-parallel engine writes its own folder, so no
    worker waits for another inside the one RPC they all run.
    """
    root = Path(root)
    folder = root / f"v{version}-w{worker}"
    partial = root / f".{folder.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    # Copies on the host: the tensors are views into the receive bucket (maybe on a GPU).
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
    save_file(tensors, partial / WEIGHTS, metadata={"format": "pt"})
    shutil.copy(root / CONFIG, partial / CONFIG)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    for old in root.glob(f"v*-w{worker}"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder
