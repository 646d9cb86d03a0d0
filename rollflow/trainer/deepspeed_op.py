"""DeepSpeed's CPU all-reduce op, built once per machine and versions, then loaded as built.

On CPU, DeepSpeed's communication init asks for its shared-memory all-reduce op
(``deepspeed_shm_comm``), which torch's JIT compiles into ``TORCH_EXTENSIONS_DIR`` on first use:
~55 s of both cores (two C++ files against torch's headers). torch decides whether to rebuild
from the build's commands, and those name the Python environment's paths, so every new checkout
(each CI clone) compiled it again, and two checkouts sharing one folder rebuilt it at every
switch. The library itself depends on Python's ABI, the versions of torch and DeepSpeed and
this CPU (``-march=native``), not on where the environment lives: the folder is keyed by those
(``services/trainer_process.py``, ``torch_extensions_dir``), and a rank that finds the library
there loads it and hands it to DeepSpeed's op cache before DeepSpeed asks, so torch's JIT never
runs again. The first rank on a machine builds it the usual way (torch's lock keeps it to one).

Invariant: whatever happens here, DeepSpeed gets its op: a library that cannot be loaded (a
build under way, a file cut short) leaves DeepSpeed to its own JIT load.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME (its JIT module's name)


def built_op_path(root: str | None = None) -> Path:
    """Where torch's JIT puts the op's library (``<root>/<name>/<name>.so``); ``root``: this
    process's ``TORCH_EXTENSIONS_DIR``, or torch's default."""
    from torch.utils.cpp_extension import get_default_build_root

    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / OP / f"{OP}.so"


def load_built_op() -> Path | None:
    """Give DeepSpeed the op built before on this machine, if there is one; returns its path.

    Call before ``deepspeed.init_distributed`` on CPU. None: DeepSpeed loads (or builds) it.
    """
    from deepspeed.ops.op_builder.builder import OpBuilder

    path = built_op_path()
    if OP in OpBuilder._loaded_ops or not path.is_file() or (path.parent / "lock").exists():
        return None  # (torch's lock file: a build is under way)
    try:
        spec = importlib.util.spec_from_file_location(OP, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as err:
        log.warning("DeepSpeed's %s at %s did not load (%s): DeepSpeed builds it", OP, path, err)
        return None
    OpBuilder._loaded_ops[OP] = module
    log.info("DeepSpeed's %s op loaded as built before: %s", OP, path)
    return path
