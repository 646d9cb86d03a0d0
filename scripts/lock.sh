#!/usr/bin/env bash
# Regenerate requirements/cpu.lock, what scripts/setup.sh installs: pyproject.toml's extras cpu,
# dev, deepspeed, lora and envs plus requirements/cpu.in, less requirements/overrides.txt, resolved with uv for
# CPython 3.11 on Linux x86_64 (manylinux_2_28), every version pinned, every file's sha256 listed
# (torch's excepted: see docs/install.md).
#   bash scripts/lock.sh                        # after editing dependencies: keeps the other pins
#   bash scripts/lock.sh --upgrade              # take the newest releases of everything
#   bash scripts/lock.sh --upgrade-package X    # ... of X only
#   bash scripts/lock.sh --gpu                  # requirements/gpu.lock: extras gpu, deepspeed, lora and
#                                               # check (pytest for scripts/gpu_check.sh), CUDA
#                                               # torch from PyPI (what the Dockerfile installs)
# Then run bash scripts/setup.sh (it syncs .venv to the new lock) and the tests, and commit the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
lock=requirements/cpu.lock
uv=${UV:-.venv/bin/uv}
[ -x "$uv" ] || uv=$(command -v uv) \
  || { echo "lock: needs uv: run bash scripts/setup.sh first (it puts uv in .venv), or set UV=/path/to/uv" >&2; exit 1; }
if [ "${1:-}" = "--gpu" ]; then
  shift
  "$uv" pip compile -q pyproject.toml --extra gpu --extra deepspeed --extra lora --extra check --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --generate-hashes \
    --custom-compile-command "bash scripts/lock.sh --gpu" -o requirements/gpu.lock "$@"
  echo "lock: wrote requirements/gpu.lock ($(grep -c '^[a-z0-9]' requirements/gpu.lock) packages)"
  exit 0
fi
. scripts/torch_source.sh
torch_src=$(torch_source "$PYTHON")
"$uv" pip compile -q pyproject.toml requirements/cpu.in --extra cpu --extra dev --extra deepspeed --extra lora --extra envs \
  --overrides requirements/overrides.txt --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --find-links "$torch_src" --generate-hashes --custom-compile-command "bash scripts/lock.sh" \
  -o "$lock" "$@"
# torch's one hash is that of the wheel found above; PyTorch's index may serve a file that differs
# from a local copy, so torch is pinned by its exact version (+cpu) only.
"$PYTHON" - "$lock" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text, n = re.subn(r"^(torch==\S+) \\\n(    --hash=\S+(?: \\)?\n)+", r"\1\n", text, flags=re.M)
assert n == 1 and "\ntorch==2.13.0+cpu\n" in text, "lock: expected exactly one torch==2.13.0+cpu entry"
for name in ("torchvision", "torchaudio", "torchcodec", "nvidia-"):
    assert not re.search(rf"^{name}", text, flags=re.M), f"lock: {name} must not be in the lock"
open(path, "w").write(text)
PY
echo "lock: wrote $lock ($(grep -c '^[a-z0-9]' "$lock") packages, torch from $torch_src)"
