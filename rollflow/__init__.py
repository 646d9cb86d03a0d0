"""rollflow: asynchronous RL post-training as Prefect workflows.

The package's public Python API is ``open_run`` (``rollflow.runs``): a run's committed data for
notebooks and scripts. It is imported on first use, so ``import rollflow`` stays cheap (no
torch, vLLM or Prefect).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflow.runs import Run, open_run

__all__ = ["Run", "open_run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollflow import runs

        return getattr(runs, name)
    raise AttributeError(f"module 'rollflow' has no attribute {name!r}")
