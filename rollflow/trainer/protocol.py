"""What crosses into the trainer service: its start arguments and the body of every call.

One model per request, used at every hop: the client (``tasks/train/client.py``) builds it, rank 0's HTTP
API (``api.py``) parses it, rank 0 broadcasts it to every rank as the command's arguments, and
each rank (``ops.py``) parses it again. Losses use the run config's own ``LossConfig`` and the
service its ``TrainSection`` / ``TrainerSection``: every default lives in ``infra/config.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollflow.infra.config import LossConfig, SamplingSection, TrainerSection, TrainSection


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServiceArgs(_Body):
    """Everything the ranks need at start (one JSON file, read by every rank)."""

    model_path: str
    checkpoint_step: int | None = Field(
        None, description="model_path is that checkpoint: load its trainer state"
    )
    storage_root: str
    storage_options: dict[str, Any] = {}
    run: str
    seed: int = 0
    num_steps: int | None = Field(
        None, description="The run's last outer step: training_finished follows it"
    )
    train: TrainSection = Field(default_factory=TrainSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sampling: SamplingSection = Field(
        default_factory=SamplingSection,
        description="How the rollouts were sampled: log-probs are taken at its temperature and top-p",
    )
    reference_model_path: str | None = Field(
        None,
        description="The KL term's frozen policy; default: the checkpoint's record, else model_path",
    )
    host: str = "127.0.0.1"
    port: int = 0
    dead_rank_grace_s: float = Field(
        10.0, description="After a rank died: how long rank 0 answers 503 naming it"
    )
    log_path: str = ""

    @property
    def needs_reference(self) -> bool:
        return self.train.loss.kl_coef > 0


class BatchRef(_Body):
    """A committed batch step, optionally restricted to some of its groups."""

    step: int
    group_indices: list[int] | None = None


class ForwardBackward(BatchRef):
    samples: list[tuple[int, int]] | None = Field(
        None, description="(group, sample) keys: only these rows of the groups"
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    old_logprobs: Literal["inference", "trainer"] = "inference"
    num_loss_tokens: int | None = Field(
        None, gt=0, description="Denominator of the whole optimizer step"
    )


class StepRef(_Body):
    step: int


class ExportHF(_Body):
    uri: str


class Gradients(_Body):
    path: str


class WeightConnect(_Body):
    host: str
    port: int
    world_size: int
    timeout_s: float
    wire_device: Literal["cpu", "cuda"]  # the plan's (placement.choose_backend); no default
    bucket_bytes: int = Field(gt=0)


class Broadcast(_Body):
    # None: the weights of the last finished step, tagged with that step (``weights_version``);
    # refused while a step is training (a restarted vLLM's re-sync waits for a step boundary).
    version: int | None = None
