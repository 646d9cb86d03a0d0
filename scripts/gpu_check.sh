#!/usr/bin/env bash
# The GPU branch on a GPU node: pytest -m gpu, then one table for docs/performance.md.
#   bash scripts/gpu_check.sh            (after scripts/setup.sh, or inside the rollflow image)
# Without CUDA every GPU test skips with its reason, and the table says so.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
out=$(mktemp -d)
"$PY" - <<'PY'
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s): {names}")
PY
"$PY" -m pytest -m gpu tests/integration/gpu -v -s -rs --junitxml "$out/gpu.xml" -p no:cacheprovider | tee "$out/log"
rc=${PIPESTATUS[0]}
"$PY" - "$out/gpu.xml" "$out/log" <<'PY'
import re, sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
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
PY
exit $rc
