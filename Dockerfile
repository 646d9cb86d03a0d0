# The image the GPU work pools run (workpools/*: rollflow:latest): CUDA, Python 3.11, rollflow with
# its gpu and deepspeed extras installed from requirements/gpu.lock (hashed, CUDA torch from PyPI).
# The repository is at /opt/rollflow (the WORKDIR below): prefect.yaml's `working_dir` of the
# container pools names the same folder (tests/unit/test_image.py checks they agree); the
# virtualenv is apart, at /opt/venv.
#
#   docker build -t rollflow:latest .        # or: bash scripts/build_image.sh
#
# The tests do not build it (no Docker here); scripts/gpu_check.sh runs inside it on a GPU node.
# CUDA 13.0, as requirements/gpu.lock's torch (cuda-toolkit 13.0.x, nvidia-nccl-cu13): the host
# needs NVIDIA driver 580 or newer (docs/install.md, "GPU nodes"; tests/unit/test_image.py).
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common curl ca-certificates git \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir uv==0.13.9

WORKDIR /opt/rollflow
# Dependencies first (a layer that changes only with the lock), then the code.
COPY requirements/gpu.lock requirements/gpu.lock
RUN DS_BUILD_OPS=0 uv pip sync --python /opt/venv/bin/python requirements/gpu.lock
COPY . .
RUN uv pip install --python /opt/venv/bin/python --no-deps -e .

CMD ["rollflow", "--help"]
