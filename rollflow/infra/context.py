"""What a step's tasks need to find the run's services and data (small and JSON-able)."""

from __future__ import annotations

from functools import cached_property

from pydantic import BaseModel, ConfigDict

from rollflow.infra.config import RunConfig
from rollflow.infra.http import Endpoint
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.fleet import Fleet, fleet_of


class RunContext(BaseModel):
    """The resolved config plus where the trainer and the inference deployment's servers listen."""

    model_config = ConfigDict(arbitrary_types_allowed=True, ignored_types=(cached_property,))

    config: RunConfig
    model_path: str  # the policy's HF directory at start (tokenizer, architecture)
    trainer: Endpoint
    inference: list[Endpoint]  # the vLLM servers when the context was made (one token for all)
    trainer_restarts: int = 0  # how often the run restarted a lost trainer before this context
    resumed_from: int = 0  # the committed checkpoint the trainer started from (0: none)

    def inference_fleet(self) -> Fleet:
        """The servers that serve now: the run's fleet where its services run in this process
        (it grows and shrinks, ``infra/vllm_fleet/fleet.py``), else the ones given."""
        return fleet_of(self.config.run.name) or Fleet([e.url for e in self.inference])

    @property
    def inference_urls(self) -> list[str]:
        return self.inference_fleet().urls()

    @cached_property
    def storage(self) -> RunStorage:
        run = self.config.run
        return RunStorage(run.storage, run.name, run.storage_options)
