# Sourced by scripts/setup.sh and scripts/lock.sh: where torch 2.13.0's CPU build is, and a check
# that the interpreter is the one requirements/cpu.lock was compiled for.
#
# The lock pins torch==2.13.0+cpu. PyPI has no such file (its torch 2.13.0 is the multi-GB CUDA
# build), so uv is given one place that has it, as a find-links location:
#   1. a local wheel folder: $ROLLFLOW_WHEELS if set (even to an empty folder), else pip's own
#      find-links settings (PIP_FIND_LINKS, `pip config` global.find-links / install.find-links);
#   2. PyTorch's CPU wheel page, $ROLLFLOW_TORCH_INDEX (default below), if it answers and lists
#      the wheel;
#   3. otherwise it stops with what to do.

ROLLFLOW_TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
ROLLFLOW_TORCH_INDEX=${ROLLFLOW_TORCH_INDEX:-https://download.pytorch.org/whl/cpu/torch/}

# check_python PYTHON: stop unless it is CPython 3.11 on Linux x86_64 (the lock's platform).
check_python() {
  local found
  found=$("$1" -c 'import platform, sys; print(platform.python_implementation(), platform.python_version(), sys.platform, platform.machine())') \
    || { echo "setup: cannot run $1; set PYTHON=/path/to/python3.11" >&2; exit 1; }
  case "$found" in
    "CPython 3.11."*" linux x86_64") ;;
    *) echo "setup: requirements/cpu.lock is compiled for CPython 3.11 on Linux x86_64, but $1 is" \
            "$found. Run with PYTHON=/path/to/python3.11 (and remove a .venv made by another" \
            "Python), or recompile the lock for your platform (see docs/install.md)." >&2
       exit 1 ;;
  esac
}

# torch_source PYTHON: print the find-links location that holds the wheel, or stop with a message.
torch_source() {
  local py=$1 dirs d why where
  if [ -n "${ROLLFLOW_WHEELS+set}" ]; then
    dirs=$ROLLFLOW_WHEELS where="ROLLFLOW_WHEELS"
  else
    dirs="${PIP_FIND_LINKS:-} $("$py" -m pip config get global.find-links 2>/dev/null || true)"
    dirs="$dirs $("$py" -m pip config get install.find-links 2>/dev/null || true)"
    where="pip's find-links"
  fi
  for d in $dirs; do
    d=${d#file://}
    if [ -f "$d/$ROLLFLOW_TORCH_WHEEL" ]; then echo "$d"; return 0; fi
  done
  if why=$("$py" - "$ROLLFLOW_TORCH_INDEX" "$ROLLFLOW_TORCH_WHEEL" 2>&1 <<'EOF'
import sys, urllib.parse, urllib.request
url, wheel = sys.argv[1:]
try:
    page = urllib.parse.unquote(urllib.request.urlopen(url, timeout=20).read().decode())
except Exception as exc:
    sys.exit(f"not reachable: {exc}")
sys.exit(0 if wheel in page else f"reachable, but it does not list {wheel}")
EOF
  ); then
    echo "$ROLLFLOW_TORCH_INDEX"; return 0
  fi
  dirs=$(echo $dirs)
  echo "setup: stopped: torch 2.13.0's CPU build ($ROLLFLOW_TORCH_WHEEL) was not found." \
       "requirements/cpu.lock pins torch==2.13.0+cpu, which PyPI does not have (PyPI's torch is the" \
       "multi-GB CUDA build, which this setup will not install). Looked in the local wheel" \
       "folder(s) ($where: ${dirs:-none}) and at" \
       "$ROLLFLOW_TORCH_INDEX ($why). To fix: download that wheel from" \
       "https://download.pytorch.org/whl/cpu/torch/ (on any machine that can reach it), put it in a" \
       "folder and run ROLLFLOW_WHEELS=/that/folder bash scripts/setup.sh; or set" \
       "ROLLFLOW_TORCH_INDEX to a mirror of that page." >&2
  exit 1
}
