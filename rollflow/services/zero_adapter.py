"""The zero LoRA adapter a run's vLLM serves before the first sync, written by a short child.

Under ``train.lora.sync = "adapter"`` a fresh run's servers start serving a zero adapter (A = B =
0: the base model). Writing it takes the trainer's code (``lora.save_initial_adapter``: the
model's module tree on the meta device, peft's injection), so it runs as a child process of the
trainer's module ``protocol.ZERO_ADAPTER_MODULE`` with a deadline: the run process loads neither
the trainer's code nor peft. Its output goes to a log beside the adapter, which a failure names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rollflow.infra.config import LoraSection
from rollflow.infra.errors import ConfigError, ServiceError
from rollflow.infra.processes import log_tail
from rollflow.trainer.protocol import ZERO_ADAPTER_MODULE

# Mostly imports (~5 s on a warm disk); a cold shared file system can take a minute or more.
ZERO_ADAPTER_TIMEOUT_S = 300.0


def write_zero_adapter(
    folder: str | Path,
    base_model: str | Path,
    cfg: LoraSection,
    timeout_s: float = ZERO_ADAPTER_TIMEOUT_S,
) -> Path:
    """Write the zero adapter of ``cfg`` for ``base_model`` to ``folder`` (peft's format); its
    log is ``<folder>.log``. Raises ``ConfigError`` where ``cfg`` does not fit the model (no
    target module matched), else ``ServiceError`` naming the log."""
    folder = Path(folder)
    log = folder.with_name(folder.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", ZERO_ADAPTER_MODULE, str(folder), str(base_model)]
    what = f"the zero LoRA adapter of {base_model}"
    with log.open("w") as out:
        try:
            done = subprocess.run(
                [*argv, cfg.model_dump_json()],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ServiceError(
                f"{what} was not written within {timeout_s:.0f}s; see {log}"
            ) from None
    if done.returncode == 0:
        return folder
    last = (log_tail(log, 1).strip() or "no output").splitlines()[-1]
    if done.returncode == 2:  # the module's own exit for a config that does not fit the model
        raise ConfigError(f"{last} (writing {what}; see {log})")
    raise ServiceError(f"{what} was not written (exit {done.returncode}): {last}; see {log}")
