"""What crosses into the trainer service: its start arguments, and every route with its body.

Owns: the route of every trainer call (method, path, request body, and whether every rank runs
it), declared once below beside its body. The client (``tasks/train/client.py``) calls a route
and builds its body, rank 0's HTTP API (``api.py``) serves it and parses the body, rank 0
broadcasts it to every rank as the command ``route.op``, and each rank (``ops.py``) parses it
again. No route string appears anywhere else. Losses use the run config's own ``LossConfig`` and
the service its ``TrainSection`` / ``TrainerServiceSection``: every default lives in ``infra/config/``.

Imported by the orchestrator's side: keep it free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollflow.infra.config import LossConfig, SamplingSection, TrainerServiceSection, TrainSection

# The ranks' entry point (``rank_main.py``), run by the launcher as a module. Named, not imported:
# importing it would load torch's distributed stack and DeepSpeed into the run process (~7 s).
RANK_MAIN_MODULE = "rollflow.trainer.rank_main"
# The ranks' environment, set by the launcher (``services/trainer_process.py``): the run's token
# (rank 0's API refuses a request without it; it is the weight group's secret too, which vLLM's
# workers hold as their server's key), and each rank's threads (default: its share of the cores).
TOKEN_ENV = "ROLLFLOW_TOKEN"
THREADS_ENV = "ROLLFLOW_TRAINER_THREADS"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Route:
    """One trainer call: HTTP method, path, request body (None: no body), and whether it is a
    command that every rank runs (``op``) or one that rank 0 answers alone."""

    method: Literal["GET", "POST"]
    path: str
    body: type[_Body] | None = None
    command: bool = True

    @property
    def op(self) -> str:
        """The command's name on the control channel: the path, ``/`` as ``_``."""
        return self.path.strip("/").replace("/", "_")


class ServiceArgs(_Body):
    """Everything the ranks need at start (one JSON file, read by every rank)."""

    model_path: str
    checkpoint_step: int | None = Field(
        None, description="model_path is that checkpoint: load its trainer state"
    )
    model_in_storage: tuple[Literal["policy", "checkpoints"], int] | None = Field(
        None,
        description="Where a node without model_path's folder (another host) finds it in the "
        "run's storage: (kind, step); it loads a local copy",
    )
    storage_root: str
    storage_options: dict[str, Any] = {}
    run: str
    seed: int = 0
    num_steps: int | None = Field(
        None, description="The run's last outer step: training_finished follows it"
    )
    train: TrainSection = Field(default_factory=TrainSection)
    trainer: TrainerServiceSection = Field(default_factory=TrainerServiceSection)
    sampling: SamplingSection = Field(
        default_factory=SamplingSection,
        description="How the rollouts were sampled: log-probs are taken at its temperature and top-p",
    )
    reference_model_path: str | None = Field(
        None,
        description="The KL term's frozen policy; default: the checkpoint's record, else model_path",
    )
    weight_dtype: str = Field(
        "float32", description="The dtype vLLM serves: weight syncs travel in it"
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


# ------------------------------------------------------------------------- the routes

HEALTH = Route("GET", "/health", command=False)  # ok, optimizer step, weights version, ranks
TRAINING_FINISHED = Route("GET", "/training_finished", command=False)  # ?wait_s= long poll


class BatchRef(_Body):
    """A committed batch step, optionally restricted to some of its groups."""

    step: int
    group_indices: list[int] | None = None


FORWARD = Route("POST", "/forward", BatchRef)


class ForwardBackward(BatchRef):
    samples: list[tuple[int, int]] | None = Field(
        None, description="(group, sample) keys: only these rows of the groups"
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    old_logprobs: Literal["inference", "trainer"] = "inference"
    num_loss_tokens: float | None = Field(
        None,
        gt=0,
        description="Denominator of the whole optimizer step's token mean (default: its loss "
        "tokens on all ranks; train.token_mean = 'batch': the step's over its mini-batches)",
    )


FORWARD_BACKWARD = Route("POST", "/forward_backward", ForwardBackward)
OPTIM_STEP = Route("POST", "/optim_step")


class StepRef(_Body):
    step: int


END_STEP = Route("POST", "/end_step", StepRef, command=False)  # rank 0 keeps the step state
SAVE_CHECKPOINT = Route("POST", "/save_checkpoint", StepRef)
LOAD_CHECKPOINT = Route("POST", "/load_checkpoint", StepRef)


class ExportHF(_Body):
    uri: str


EXPORT_HF = Route("POST", "/export_hf", ExportHF)


class Gradients(_Body):
    path: str


GRADIENTS = Route("POST", "/gradients", Gradients)
WEIGHTS_METADATA = Route("GET", "/weights/metadata", command=False)
# A port free right now on the trainer's host, where rank 0 will host the weight group's store:
# chosen there, not by the run's process, which may be on another host.
WEIGHTS_PORT = Route("GET", "/weights/port", command=False)


class WeightConnect(_Body):
    host: str
    port: int
    world_size: int
    timeout_s: float
    wire_device: Literal["cpu", "cuda"]  # the plan's (placement.choose_backend); no default
    bucket_bytes: int = Field(gt=0)


WEIGHTS_CONNECT = Route("POST", "/weights/connect", WeightConnect)


class Broadcast(_Body):
    # None: the weights of the last finished step, tagged with that step (``weights_version``);
    # while a step is training, waited for up to ``wait_s`` (its end), then refused (409).
    version: int | None = None
    wait_s: float = Field(0.0, ge=0)


WEIGHTS_CAPTURE = Route("POST", "/weights/capture", Broadcast)
WEIGHTS_BROADCAST = Route("POST", "/weights/broadcast", Broadcast)
WEIGHTS_CLOSE = Route("POST", "/weights/close")
SHUTDOWN = Route("POST", "/shutdown")  # every rank tears down, then the service exits

ROUTES = tuple(v for v in list(globals().values()) if isinstance(v, Route))
"""Every route the HTTP API serves (``api.build_app`` serves each exactly once)."""
