"""What crosses into the trainer service: its start arguments, and every route with its body
and its reply.

Owns: the route of every trainer call (method, path, request body, reply, and whether every rank
runs it), declared once below beside its body and reply. The client (``tasks/train/client.py``)
calls a route, builds its body and parses the reply (``route.parse``); rank 0's HTTP API
(``api.py``) serves it, parses the body, and holds what it answers to the reply model
(``route.reply_json``), so a reply that drifts fails on rank 0, naming the field; rank 0
broadcasts the body to every rank as the command ``route.op``, and each rank (``ops.py``) parses
it again. No route string appears anywhere else. Losses use the run config's own ``LossConfig`` and
the service its ``TrainSection`` / ``TrainerServiceSection``: every default lives in ``infra/config/``.

Imported by the orchestrator's side: keep it free of torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rollflow.infra.config import LossConfig, SamplingSection, TrainerServiceSection, TrainSection
from rollflow.infra.moments import PerEnvJSON

# The ranks' entry point (``rank_main.py``), run by the launcher as a module. Named, not imported:
# importing it would load torch's distributed stack and DeepSpeed into the run process (~7 s).
RANK_MAIN_MODULE = "rollflow.trainer.rank_main"
# Writes the zero LoRA adapter vLLM serves before a run's first sync (``zero_adapter.py``), run
# as a short child process: the run process loads neither the trainer's code nor peft.
ZERO_ADAPTER_MODULE = "rollflow.trainer.zero_adapter"
# The ranks' environment, set by the launcher (``services/trainer_process.py``): the run's token
# (rank 0's API refuses a request without it; it is the weight group's secret too, which vLLM's
# workers hold as their server's key), and each rank's threads (default: its share of the cores).
TOKEN_ENV = "ROLLFLOW_TOKEN"
THREADS_ENV = "ROLLFLOW_TRAINER_THREADS"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    """A reply of a fixed shape: a key missing, extra or of the wrong type is an error naming it."""

    model_config = ConfigDict(extra="forbid")


@functools.cache
def _adapter(reply: Any) -> TypeAdapter:
    return TypeAdapter(reply)


@dataclass(frozen=True)
class Route:
    """One trainer call: HTTP method, path, request body (None: no body), its reply (a model, or
    a list of one), and whether it is a command that every rank runs (``op``) or one that rank 0
    answers alone."""

    method: Literal["GET", "POST"]
    path: str
    body: type[_Body] | None = None
    command: bool = True
    reply: Any = field(kw_only=True)

    @property
    def op(self) -> str:
        """The command's name on the control channel: the path, ``/`` as ``_``."""
        return self.path.strip("/").replace("/", "_")

    def parse(self, data: Any) -> Any:
        """The reply's JSON as ``reply`` (``pydantic.ValidationError`` names what does not fit)."""
        return _adapter(self.reply).validate_python(data)

    def reply_json(self, value: Any) -> Any:
        """``value`` (the reply model, or its dict) held to ``reply``, as JSON-able data: the
        keys it was given, so the wire carries what the handler answered."""
        adapter = _adapter(self.reply)
        return adapter.dump_python(adapter.validate_python(value), mode="json", exclude_unset=True)


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
    model_revision: str | None = Field(
        None, description="model.revision: the hub revision model_path is loaded at"
    )
    trust_remote_code: bool = Field(False, description="model.trust_remote_code")
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


class RankInfo(_Reply):
    """One rank's process."""

    rank: int
    pid: int
    host: str


class HealthReply(_Reply):
    """Rank 0 answers, every rank with it (a dead rank: 503 naming it instead)."""

    ok: bool
    optim_step: int = Field(description="Optimizer steps taken so far")
    weights_version: int | None = Field(
        description="The outer step whose optimizer steps made the current weights; None "
        "between a step's first optimizer step and its /end_step"
    )
    backend: str
    world_size: int
    ranks: list[RankInfo]
    pid: int = Field(description="Rank 0's process")


HEALTH = Route("GET", "/health", command=False, reply=HealthReply)


class FinishedReply(_Reply):
    """Whether training has ended (after the end of step ``num_steps``); once it has, where."""

    finished: bool
    step: int | None = Field(None, description="The run's last step (once finished)")
    optim_step: int | None = Field(None, description="The optimizer step it ended at")
    time: float | None = Field(None, description="When it ended (Unix time)")


# ?wait_s= long poll
TRAINING_FINISHED = Route("GET", "/training_finished", command=False, reply=FinishedReply)


class BatchRef(_Body):
    """A committed batch step, optionally restricted to some of its groups."""

    step: int
    group_indices: list[int] | None = None


class ForwardReply(_Reply):
    """The trainer's own log-probs of the batch, written to ``logprobs/step=N``."""

    uri: str
    num_sequences: int
    forward_s: float


FORWARD = Route("POST", "/forward", BatchRef, reply=ForwardReply)


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


class ForwardBackwardReply(_Reply):
    """One mini-batch's gradients accumulated on every rank: its figures over all ranks. The loss
    terms are over the step's denominator, the other means over its loss tokens."""

    loss: float
    pg_loss: float
    num_loss_tokens: int
    num_tokens: int
    clip_fraction: float
    entropy: float
    mismatch_kl: float
    kl: float
    tis_weight: float
    is_masked_fraction: float
    is_ratio_q05: float
    is_ratio_q50: float
    is_ratio_q95: float
    ess: float = Field(description="Normalised effective sample size of the importance weights")
    per_env: PerEnvJSON = Field(description="Per-sequence figures' moments by environment")
    forward_backward_s: float


FORWARD_BACKWARD = Route("POST", "/forward_backward", ForwardBackward, reply=ForwardBackwardReply)


class OptimStepReply(_Reply):
    grad_norm: float = Field(description="Before clipping")
    lr: float = Field(description="The learning rate this step took")
    optim_step: int = Field(description="Optimizer steps taken, this one included")
    optim_step_s: float


OPTIM_STEP = Route("POST", "/optim_step", reply=OptimStepReply)


class StepRef(_Body):
    step: int


class EndStepReply(_Reply):
    finished: bool = Field(description="Training ended with this step (the run's last)")


# Rank 0 keeps the step state.
END_STEP = Route("POST", "/end_step", StepRef, command=False, reply=EndStepReply)


class SavedReply(_Reply):
    uri: str = Field(description="The committed checkpoint, ``checkpoints/step=N``")
    checkpoint_s: float


SAVE_CHECKPOINT = Route("POST", "/save_checkpoint", StepRef, reply=SavedReply)


class LoadedReply(_Reply):
    optim_step: int = Field(description="The checkpoint's optimizer steps")
    path: str = Field(description="Rank 0's local copy of the checkpoint")


LOAD_CHECKPOINT = Route("POST", "/load_checkpoint", StepRef, reply=LoadedReply)


class ExportHF(_Body):
    uri: str


class ExportedReply(_Reply):
    uri: str


EXPORT_HF = Route("POST", "/export_hf", ExportHF, reply=ExportedReply)


class Gradients(_Body):
    path: str


class GradientsReply(_Reply):
    path: str
    num_tensors: int


GRADIENTS = Route("POST", "/gradients", Gradients, reply=GradientsReply)


class TensorMeta(_Reply):
    """One tensor a weight sync carries, in wire order (``infra/weights/group.weight_metadata``)."""

    name: str
    shape: list[int]
    dtype: str = Field(description="torch's name without the prefix, e.g. float32")


WEIGHTS_METADATA = Route("GET", "/weights/metadata", command=False, reply=list[TensorMeta])


class PortReply(_Reply):
    port: int


# A port free right now on the trainer's host, where rank 0 will host the weight group's store:
# chosen there, not by the run's process, which may be on another host.
WEIGHTS_PORT = Route("GET", "/weights/port", command=False, reply=PortReply)


class WeightConnect(_Body):
    host: str
    port: int
    world_size: int
    timeout_s: float
    wire_device: Literal["cpu", "cuda"]  # the plan's (placement.choose_backend); no default
    bucket_bytes: int = Field(gt=0)


class OkReply(_Reply):
    ok: bool


WEIGHTS_CONNECT = Route("POST", "/weights/connect", WeightConnect, reply=OkReply)


class Broadcast(_Body):
    # None: the weights of the last finished step, tagged with that step (``weights_version``);
    # while a step is training, waited for up to ``wait_s`` (its end), then refused (409).
    version: int | None = None
    wait_s: float = Field(0.0, ge=0)


class CapturedReply(_Reply):
    """The weights kept on rank 0 as ``version``, for a later broadcast of that version."""

    version: int
    capture_s: float
    bytes: int


class SentReply(_Reply):
    """The weights sent to the weight group as ``version``."""

    version: int
    bytes: int
    broadcast_s: float
    captured: bool = Field(False, description="Sent from a capture, off the ranks' command loop")


WEIGHTS_CAPTURE = Route("POST", "/weights/capture", Broadcast, reply=CapturedReply)
WEIGHTS_BROADCAST = Route("POST", "/weights/broadcast", Broadcast, reply=SentReply)
WEIGHTS_CLOSE = Route("POST", "/weights/close", reply=OkReply)
# Every rank tears down, then the service exits.
SHUTDOWN = Route("POST", "/shutdown", reply=OkReply)

ROUTES = tuple(v for v in list(globals().values()) if isinstance(v, Route))
"""Every route the HTTP API serves (``api.build_app`` serves each exactly once)."""
