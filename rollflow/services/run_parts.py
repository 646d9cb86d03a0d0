"""What every part of a run's services shares (``RunParts``), made once by ``RunServices``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.placement import Plan
from rollflow.infra.storage import RunStorage


@dataclass(frozen=True)
class RunParts:
    """The resolved config, the placement plan, the run's storage, the run's token (every
    service's key), where the services' logs go, and how the run says what it does."""

    cfg: RunConfig
    plan: Plan
    storage: RunStorage
    token: str
    log_dir: Path
    progress: Callable[[str], None] = print
