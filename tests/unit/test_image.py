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


def _dockerfile_source_dir() -> str:
    """The WORKDIR in force where the Dockerfile copies the repository (`COPY . .`)."""
    workdir = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("WORKDIR "):
            workdir = line.split(None, 1)[1].strip()
        if line.split() == ["COPY", ".", "."]:
            assert workdir, "the Dockerfile copies the repository before any WORKDIR"
            return workdir
    raise AssertionError("the Dockerfile never copies the repository (COPY . .)")


def test_container_pools_run_from_where_the_image_holds_the_repository():
    import yaml

    source = _dockerfile_source_dir()
    venv = re.search(r"VIRTUAL_ENV=(\S+)", (ROOT / "Dockerfile").read_text()).group(1)
    assert source != venv, "the repository and the virtualenv share a folder"
    pools = yaml.safe_load((ROOT / "prefect.yaml").read_text())["definitions"]["work_pools"]
    containers = {n: p for n, p in pools.items() if p["type"] in ("docker", "kubernetes")}
    assert containers, "prefect.yaml defines no container pool"
    for name, pool in containers.items():
        assert pool.get("working_dir") == source, (
            f"prefect.yaml pool {name}: working_dir {pool.get('working_dir')!r}, but the "
            f"Dockerfile copies the repository to {source!r}"
        )


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_base_image_lock_and_driver_requirement_name_one_cuda():
    from rollflow.infra.placement import CUDA_DRIVER

    base = re.search(r"^FROM nvidia/cuda:(\d+\.\d+)\.\d+-", (ROOT / "Dockerfile").read_text(), re.M)
    assert base, "the Dockerfile's base image is not nvidia/cuda:X.Y.Z-..."
    cuda = base.group(1)
    assert _major_minor(_pinned("cuda-toolkit")) == cuda
    assert _major_minor(_pinned("nvidia-cuda-runtime")) == cuda
    major = cuda.split(".")[0]
    assert _pinned(f"nvidia-nccl-cu{major}"), f"the lock's NCCL is not built for CUDA {major}"
    assert CUDA_DRIVER.startswith(f"CUDA {cuda} needs NVIDIA driver")
    driver = re.search(r"driver (\d+) or newer", CUDA_DRIVER).group(1)
    install = (ROOT / "docs" / "install.md").read_text()
    assert f"nvidia/cuda:{cuda}." in install and f"driver {driver} or newer" in install
    assert f"CUDA {cuda}" in (ROOT / "docs" / "guides" / "single-gpu.md").read_text()
