"""What crosses into a vLLM server: the routes the run calls, the worker methods, the environment.

Owns, each declared once below:

- every route of vLLM's server that rollflow calls (method and path). The run's client
  (``infra/vllm_fleet/client.py``) and the server's launcher (``services/vllm_server.py``) name
  them from here; vLLM serves them (``VLLM_SERVER_DEV_MODE=1`` adds the development ones).
- every method of the worker extension (``worker_extension.WeightReceiver``) that the run calls
  through ``/collective_rpc``, with its argument model and its reply. vLLM passes that route
  nothing but strings, so a call sends one: its arguments as the model's JSON. The run's typed
  client of the workers (``infra/vllm_fleet/workers.py``) builds it and parses the replies; the
  worker parses it with the same model and answers with the reply model's dict.
- the names that vLLM's processes read: the environment variables rollflow sets on the server
  and the dotted paths vLLM imports (the worker extension, the key middleware).

Imported by the run's process: no torch, no vLLM, and none of the code that runs inside vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

# ------------------------------------------------------------------ what vLLM's processes read

# The server's key (``auth.RunKeyMiddleware``), and the weight group's secret on the workers.
# In the environment, which other users cannot read, not on the command line, which they can.
KEY_ENV = "ROLLFLOW_VLLM_KEY"
# Given to ``--middleware``: checks the key on every route.
MIDDLEWARE = "rollflow.inference.auth.RunKeyMiddleware"
# Given to ``--worker-extension-cls``: mixed into vLLM's worker, its methods are ``WORKER_METHODS``.
WORKER_EXTENSION_CLS = "rollflow.inference.worker_extension.WeightReceiver"
# The plugin's (``plugin.py``): the window (s) in which a reader polls instead of spinning;
# "1" to fork the engine core of a one-rank server rather than spawn it; "1" to inspect the
# model's class in the API server's own process rather than in a fresh interpreter (CPU only).
SPIN_ENV = "ROLLFLOW_VLLM_SPIN_S"
FORK_ENGINE_ENV = "ROLLFLOW_VLLM_FORK_ENGINE"
INSPECT_IN_PROCESS_ENV = "ROLLFLOW_VLLM_INSPECT_IN_PROCESS"
# A completions request's ``vllm_xargs`` key (``plugin.py``): 1 asks for token ids and log-probs
# only, no text: vLLM's API server then detokenizes nothing for it.
TOKEN_IDS_ONLY = "rollflow_token_ids_only"
# Adapter mode: the server-local folder the workers write each received adapter to
# (``infra/weights/adapter.py``); unset, the workers load the whole model.
LORA_ROOT_ENV = "ROLLFLOW_LORA_ROOT"


# ------------------------------------------------------------------ the routes


@dataclass(frozen=True)
class Route:
    """One route of vLLM's HTTP server: method, path, and the query parameters the run sends
    (each one a parameter of vLLM's handler of the route)."""

    method: Literal["GET", "POST"]
    path: str
    params: tuple[str, ...] = ()


HEALTH = Route("GET", "/health")
MODELS = Route("GET", "/v1/models")  # the served model names (a started server's check)
COMPLETIONS = Route("POST", "/v1/completions")  # token ids in, token ids and logprobs out
PAUSE = Route("POST", "/pause", params=("mode", "clear_cache"))  # ?mode=keep|abort|wait
RESUME = Route("POST", "/resume")
IS_PAUSED = Route("GET", "/is_paused")
# Answers 200 {"success": bool} (PrefixCacheReset): false while any request holds KV blocks,
# unless reset_running_requests=true, which preempts every running request first (its KV is
# recomputed when it is scheduled again).
RESET_PREFIX_CACHE = Route("POST", "/reset_prefix_cache", params=("reset_running_requests",))
COLLECTIVE_RPC = Route("POST", "/collective_rpc")  # a worker method: see WORKER_METHODS
LOAD_LORA_ADAPTER = Route("POST", "/v1/load_lora_adapter")  # bench/lora_vllm.py's comparison

ROUTES = tuple(v for v in list(globals().values()) if isinstance(v, Route))
"""Every route rollflow calls (each one vLLM 0.32 serves)."""


class PrefixCacheReset(BaseModel):
    """``/reset_prefix_cache``'s answer: whether every cached block was dropped. (Other fields a
    later vLLM may add are ignored.)"""

    success: bool


# ------------------------------------------------------------------ the worker methods


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JoinWeightGroup(_Message):
    """Every worker of the server joins the trainer's weight group."""

    host: str = Field(description="Where the group's store listens (the trainer's rank 0)")
    port: int
    first_rank: int = Field(ge=1, description="The server's first worker's rank; the others follow")
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0, description="The group's own collective timeout")
    metadata: list[dict[str, Any]] = Field(description="The trainer's weights' names and shapes")
    wire_device: Literal["cpu", "cuda"]  # the plan's (placement.choose_backend); no default
    bucket_bytes: int = Field(gt=0)


class Joined(_Message):
    rank: int = Field(description="The worker's rank in the weight group")


class ReceiveWeights(_Message):
    """Every worker receives one broadcast and loads it (no arguments)."""


class Loaded(_Message):
    version: int = Field(description="The policy version the worker now serves")


class CloseWeightGroup(_Message):
    """Every worker leaves the weight group, a no-op where not joined (no arguments)."""


Args = TypeVar("Args", bound=_Message)
Reply = TypeVar("Reply", bound=_Message)


@dataclass(frozen=True)
class WorkerMethod(Generic[Args, Reply]):
    """One method of the worker extension: its name, its argument model, its reply (None: it
    answers nothing). It takes one string, the arguments' JSON."""

    name: str
    args: type[Args]
    reply: type[Reply] | None

    def encode(self, args: Args) -> list[str]:
        """``/collective_rpc``'s ``args``: the one string the worker parses with ``decode``."""
        if not isinstance(args, self.args):
            raise TypeError(f"{self.name} takes {self.args.__name__}, not {type(args).__name__}")
        return [args.model_dump_json()]

    def decode(self, raw: str) -> Args:
        """The worker's side: the arguments from the string ``encode`` made."""
        return self.args.model_validate_json(raw)

    def answer(self, reply: Reply) -> dict[str, Any]:
        """The worker's side: what it returns (vLLM passes a dict through as JSON)."""
        return reply.model_dump()

    def failed(self, exc: BaseException) -> dict[str, Any]:
        """The worker's side: its answer when the method raised. A worker method never raises
        through vLLM: its multiproc executor reads the workers' answers in rank order and stops
        at the first failed one, leaving the others' queued, and the next call (the rejoin after
        a failed sync) then read a stale answer as its own, with tensor parallelism ≥ 2."""
        return {FAILED_KEY: f"{type(exc).__name__}: {exc}"}

    def replies(self, results: list[Any]) -> list[Reply]:
        """The run's side: each worker's reply, from ``/collective_rpc``'s ``results``; raise
        ``WorkerMethodFailed`` naming every worker whose method failed (all were read)."""
        failed = {
            i: r[FAILED_KEY]
            for i, r in enumerate(results)
            if isinstance(r, dict) and FAILED_KEY in r
        }
        if failed:
            raise WorkerMethodFailed(
                f"{self.name} failed on worker(s) "
                + "; ".join(f"{i}: {error}" for i, error in sorted(failed.items()))
            )
        if self.reply is None:
            return []
        return [self.reply.model_validate(r) for r in results]


FAILED_KEY = "rollflow_failed"  # a worker's answer when its method raised (``failed``)


class WorkerMethodFailed(RuntimeError):
    """A worker method raised on one or more workers (each worker's answer was read)."""


INIT_WEIGHT_GROUP = WorkerMethod("init_weight_group", JoinWeightGroup, Joined)
RECEIVE_WEIGHTS = WorkerMethod("receive_weights", ReceiveWeights, Loaded)
CLOSE_WEIGHT_GROUP = WorkerMethod("close_weight_group", CloseWeightGroup, None)

WORKER_METHODS = tuple(v for v in list(globals().values()) if isinstance(v, WorkerMethod))
"""Every worker method the run calls (each one ``WeightReceiver`` defines)."""


class CollectiveRpc(_Message):
    """``/collective_rpc``'s body: vLLM calls ``method`` on every worker with ``args``."""

    method: str
    args: list[str] = Field(description="Strings only: vLLM passes nothing else to a worker")
    timeout: float = Field(gt=0, description="vLLM's own deadline for the workers' answers (s)")
