"""The base of every config section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A GPU index as CUDA numbers them on one node.
GpuIndex = Annotated[int, Field(ge=0)]
# A CPU core as the kernel numbers them (os.sched_getaffinity, taskset).
CpuIndex = Annotated[int, Field(ge=0)]


class Section(BaseModel):
    """A config section: forbids unknown keys, validates assignments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
