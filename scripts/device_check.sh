#!/usr/bin/env bash
# The first call on a lent GPU machine: one table for docs/performance.md ("GPU: device check").
#   bash scripts/device_check.sh          (carry .whl/ with the DeepSpeed and pydantic wheels)
# Without a GPU it fails at once with one line saying so. See bench/device_check.py.
# Not the GPU node's pytest run of the whole GPU branch (vLLM included): that is scripts/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # The repo's venv where there is one (here: CPU torch, so the check says no GPU), else the
  # machine's python3 (the lent machine's image).
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "device check: $PY has no torch; run it where torch is installed (PYTHON=...)" >&2
  exit 1
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device check: no CUDA device visible to $("$PY" -c 'import torch; print("torch", torch.__version__)'); run it on a GPU machine" >&2
  exit 1
fi
# Packages the lent image lacks travel as wheels (DeepSpeed, pydantic, hjson): install them aside.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/rollflow-site .whl/*.whl || echo "device check: the carried wheels did not install" >&2
  export PYTHONPATH=/tmp/rollflow-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
exec "$PY" bench/device_check.py --json "${OUT:-/tmp}/device_check.json" "$@"
