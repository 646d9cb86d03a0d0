"""The GPU image (Dockerfile), its lock and the deployment file agree (files read, nothing built)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_LOCK = (ROOT / "requirements" / "gpu.lock").read_text()


def _pinned(name: str) -> str | None:
    found = re.search(rf"^{re.escape(name)}==(\S+) \\\n    --hash=sha256:", GPU_LOCK, flags=re.M)
    return found.group(1) if found else None


def test_the_image_lock_holds_pytest_for_gpu_check():
    # scripts/gpu_check.sh runs pytest inside the image, which installs requirements/gpu.lock only.
    assert _pinned("pytest") and _pinned("pytest-timeout") and _pinned("iniconfig")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pytest") for d in extras["optional-dependencies"]["check"])
    lock_sh = (ROOT / "scripts" / "lock.sh").read_text()
    gpu_compile = next(line for line in lock_sh.splitlines() if "--extra gpu " in line)
    assert "--extra check" in gpu_compile
