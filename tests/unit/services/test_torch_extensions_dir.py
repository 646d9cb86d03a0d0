"""DeepSpeed's JIT ops folder: one per machine and versions, shared by every checkout."""

from __future__ import annotations

import importlib.metadata
import sys

from rollflow.services.trainer_process import torch_extensions_dir


def test_two_checkouts_of_the_same_versions_share_one_folder(monkeypatch):
    """A new clone (CI's, each run) finds the op its predecessors built: the folder does not
    depend on where the environment lives (it was keyed by sys.prefix: each clone built again,
    ~55 s of both cores in the suite's first DeepSpeed start)."""
    here = torch_extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/tmp/another-clone/.venv")
    assert torch_extensions_dir() == here


def test_another_torch_or_deepspeed_gets_a_folder_of_its_own(monkeypatch):
    here = torch_extensions_dir()
    real = importlib.metadata.version
    for package in ("torch", "deepspeed"):
        with monkeypatch.context() as patch:
            patch.setattr(
                importlib.metadata,
                "version",
                lambda name, p=package: "0.0.1" if name == p else real(name),
            )
            assert torch_extensions_dir() != here, package
