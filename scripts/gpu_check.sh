#!/usr/bin/env bash
# The GPU branch on a GPU node of a real deployment: pytest -m gpu (tests/integration/gpu: NCCL
# weight group, Triton kernel, bf16 FSDP2 step, a 3-step run with vLLM), then one table for
# docs/performance.md. Run it inside the rollflow image (requirements/gpu.lock holds pytest: the
# `check` extra) or a CUDA install of the gpu extras:
#   docker run --gpus all rollflow:latest bash scripts/gpu_check.sh
# Not the lent machine's check (no vLLM there): that is scripts/device_check.sh.
# Without a GPU visible to torch it fails at once with one line saying so (never a run of skips).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # The image's python (the virtualenv on PATH) where there is no repo venv.
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
if ! "$PY" -c "import pytest, torch" 2>/dev/null; then
  echo "gpu check: $PY lacks pytest or torch; run it in the rollflow image (requirements/gpu.lock) or set PYTHON=..." >&2
  exit 1
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu check: no GPU visible to $("$PY" -c 'import torch; print("torch", torch.__version__, "(CUDA", torch.version.cuda, end=")")') here: run it on a GPU node (driver for CUDA 13: see docs/install.md)" >&2
  exit 1
fi
out=$(mktemp -d)
"$PY" - <<'PY'
import torch
n = torch.cuda.device_count()
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s): {names}")
PY
"$PY" -m pytest -n 0 -m gpu tests/integration/gpu -v -s -rs --junitxml "$out/gpu.xml" -p no:cacheprovider | tee "$out/log"
rc=${PIPESTATUS[0]}
"$PY" - "$out/gpu.xml" "$out/log" <<'PY'
import re, sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
passed = 0
log = open(sys.argv[2]).read()
figures = {}
for line in log.splitlines():
    for key in ("NCCL group of", "bf16 FSDP2 step", "3-step GPU run"):
        if line.startswith(key):
            figures.setdefault(key, []).append(line.strip())
print("\n| test | result | seconds | figures |\n|---|---|---|---|")
for case in cases:
    name = case.get("name")
    status = "passed"
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            status = f"{tag}: {(el.get('message') or '')[:80]}"
    fig = "; ".join(v for k, vs in figures.items() for v in vs if k.split()[0].lower() in name.lower())
    print(f"| {name} | {status} | {float(case.get('time', 0)):.1f} | {fig} |")
    passed += status == "passed"
if not passed:
    sys.exit("gpu check: no GPU test passed (every one skipped or failed): this is not a GPU check")
PY
summary=$?
[ "$rc" -ne 0 ] && exit "$rc"
exit "$summary"
