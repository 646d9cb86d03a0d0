"""``[inference]``: the vLLM deployment (servers, placement, deadlines)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rollflow.infra.config.base import CpuIndex, GpuIndex, Section

# The range of the --max-num-seqs a run gives its servers: at least what vLLM gives most GPUs (an
# evaluation's requests and another run's share the server), at most its largest default (H100
# and up): the sampler's buffers are sized for it at start, (max_num_seqs x vocabulary) logits.
MAX_NUM_SEQS = (256, 1024)


def vllm_flag(args: list[str], *names: str) -> str | None:
    """The value ``args`` (a `vllm serve` command line) give the flag ``names``; None if absent,
    "" if given without one. Both spellings: ``--flag value`` and ``--flag=value``."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            if eq:
                return value
            following = args[i + 1] if i + 1 < len(args) else ""
            return "" if following.startswith("-") else following
    return None


class InferenceSection(Section):
    """The vLLM inference deployment."""

    host: str = Field("127.0.0.1", description="Bind address of the vLLM server.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks a free one.")
    startup_timeout_s: float = Field(
        300, gt=0, description="Deadline for the server to become healthy."
    )
    request_timeout_s: float = Field(120, gt=0, description="Deadline of one completion request.")
    max_concurrency: int = Field(64, ge=1, description="Completion requests in flight at once.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of a dead vLLM server per run (0: a dead server fails the run).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra `vllm serve` arguments, after rollflow's own (a flag given twice: "
        "vLLM takes the last). rollflow sets --max-num-seqs to max_concurrency x group_size "
        "(within 256-1024) unless these set it.",
    )
    num_servers: int = Field(
        1, ge=1, description="vLLM servers (replicas); a group's completions stay on one server."
    )
    max_servers: int | None = Field(
        None,
        ge=1,
        description="The most servers the fleet may grow to while the run runs (`rollflow "
        "scale`); the plan places this many and starts num_servers of them (None: num_servers).",
    )
    server_deployment: str = Field(
        "",
        description="The Prefect deployment whose flow runs are the vLLM servers (e.g. "
        "`rollflow-inference-server/default` of prefect.yaml): the run submits one per server "
        "to its work pool, a worker on the server's host runs it, and a dead one is submitted "
        "again; empty: the servers are processes of the run flow, on its host.",
    )
    urls: list[str] = Field(
        [],
        description="vLLM servers started elsewhere (`rollflow serve`) that the run samples "
        'from instead of starting its own, e.g. ["http://10.0.0.5:8000"]: each serves the '
        "run's model architecture, and the run replaces its weights with the trainer's at the "
        "start; their key is the run's environment's ROLLFLOW_VLLM_KEY. Empty: the run starts its "
        "servers. The environment's ROLLFLOW_VLLM_URLS (comma-separated) fills it when the config "
        "does not.",
    )
    server_queues: list[str] = Field(
        [],
        description="The work queue of each server slot in turn, one per slot (fleet_slots: "
        "max_servers or num_servers; a queue per host on a process pool); empty: the "
        "deployment's queue (a Kubernetes or Docker pool places each job).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel workers per server (GPUs per server on a GPU node)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where vLLM runs; auto: CUDA when a GPU is visible, else CPU."
    )
    devices: list[GpuIndex] | None = Field(
        None,
        description="GPU indices for the servers, tensor_parallel_size consecutive ones per "
        "server (None: the first GPUs of the node).",
    )
    cpus: list[CpuIndex] | None = Field(
        None,
        description="On a host without GPUs, the CPU cores the vLLM servers are pinned to (an "
        "even share per server; their OpenMP threads bound to them), e.g. [0, 1]; None: not "
        "pinned, the threads bound to the first half of the cores.",
    )
    colocate: bool = Field(
        False,
        description="vLLM shares the trainer's GPUs (one-GPU nodes): its memory share is capped "
        "at gpu_memory_utilization.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's share of each GPU's memory (None: vLLM's 0.9, or 0.45 when colocated).",
    )

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="The dtype vLLM serves, and so the dtype weight syncs travel in "
        "(auto: bfloat16 on GPUs, float32 on CPU).",
    )

    def fleet_slots(self) -> int:
        """How many servers the placement plan places: every one the fleet may grow to."""
        return self.max_servers or self.num_servers

    @field_validator("urls")
    @classmethod
    def _base_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(
                    f"inference.urls: {url!r} is not a server's base URL: give "
                    "http://HOST:PORT, as `rollflow serve` prints it"
                )
        value = [url.rstrip("/") for url in value]
        if len(set(value)) != len(value):
            raise ValueError(f"inference.urls names a server twice: {value}")
        return value

    @model_validator(mode="after")
    def _fleet_fits(self) -> InferenceSection:
        if self.urls:
            self._external_fleet()
        if self.max_servers is not None and self.max_servers < self.num_servers:
            raise ValueError(
                f"inference.max_servers = {self.max_servers} is below inference.num_servers = "
                f"{self.num_servers}: raise max_servers, or leave it unset (= num_servers)"
            )
        if self.server_queues and len(self.server_queues) != self.fleet_slots():
            raise ValueError(
                f"inference.server_queues names {len(self.server_queues)} queue(s) for "
                f"{self.fleet_slots()} server slot(s) (inference.max_servers or num_servers): "
                "name one per slot, or none (the deployment's queue)"
            )
        if self.server_queues and not self.server_deployment:
            raise ValueError(
                "inference.server_queues is set but inference.server_deployment is empty: the "
                "queues are those of the deployment that runs the servers (e.g. "
                "rollflow-inference-server/default)"
            )
        return self

    def _external_fleet(self) -> None:
        """Servers started elsewhere: the fleet is those servers, none started or placed here."""
        for key, value, empty in (
            ("server_deployment", self.server_deployment, ""),
            ("max_servers", self.max_servers, None),
            ("colocate", self.colocate, False),
            ("devices", self.devices, None),
            ("cpus", self.cpus, None),
        ):
            if value != empty:
                raise ValueError(
                    f"inference.urls names servers started elsewhere, so inference.{key} (which "
                    f"places servers the run starts) cannot be set too: remove one of them"
                )
        if self.num_servers not in (1, len(self.urls)):
            raise ValueError(
                f"inference.num_servers = {self.num_servers} but inference.urls names "
                f"{len(self.urls)} server(s): the run uses every server it names; remove "
                "num_servers"
            )
        if self.num_servers != len(self.urls):  # (the assignment validates the section again)
            self.num_servers = len(self.urls)

    def standalone_vllm_args(self, on_gpu: bool) -> list[str]:
        """The `vllm serve` flags of a server started outside a run's plan (`rollflow eval`'s,
        `rollflow serve`'s): the serving dtype and tensor parallelism."""
        args = ["--dtype", self.serving_dtype(on_gpu=on_gpu)]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return args

    def batch_args(self, group_size: int) -> list[str]:
        """``--max-num-seqs`` that holds every sequence the run keeps in flight on one server
        (``max_concurrency`` requests of up to ``group_size`` completions each) within
        ``MAX_NUM_SEQS``, unless ``extra_args`` sets it. vLLM's own default is sized for chat
        serving, 128 sequences on a CPU (256 on most GPUs): the quickstart's 64 requests x 8
        were decoded in 4 waves, each group waiting ~0.6 s for 8 tokens (docs/performance.md,
        "Where a step's time goes")."""
        if vllm_flag(self.extra_args, "--max-num-seqs") is not None:
            return []
        in_flight = self.max_concurrency * group_size
        return ["--max-num-seqs", str(min(MAX_NUM_SEQS[1], max(MAX_NUM_SEQS[0], in_flight)))]

    def serving_dtype(self, on_gpu: bool) -> str:
        """The dtype a server on a GPU (or on CPU) serves: the one owner of that choice."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if on_gpu else "float32"

    @field_validator("extra_args")
    @classmethod
    def _owned_args(cls, value: list[str]) -> list[str]:
        if vllm_flag(value, "--logprobs-mode") is not None:
            raise ValueError(
                "inference.extra_args may not set --logprobs-mode: rollflow serves "
                "processed_logprobs (the log-probs of the distribution that sampled, which the "
                "trainer matches); remove it"
            )
        if vllm_flag(value, "--dtype") is not None:
            raise ValueError(
                "inference.extra_args may not set --dtype: the trainer sends weights in the "
                "dtype vLLM serves, so set inference.dtype instead"
            )
        return value
