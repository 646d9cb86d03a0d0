"""The trainer's HTTP API on rank 0, and the dispatcher that hands each call to the main thread.

Every route but ``/health`` and ``/weights/metadata`` becomes one JSON command for the main
thread, which runs it on every rank (``service.serve``). A route answers 400 for bad input found
before any collective (``ops.CommandError``), 503 once a rank died or a command failed
mid-collective, 504 past the call's deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from rollflow.tasks.train.control import PeerWatch
from rollflow.tasks.train.losses import LossConfig
from rollflow.tasks.train.ops import CommandError, RankOps, WeightPlaneError
from rollflow.tasks.train.trainer import Trainer

log = logging.getLogger("rollflow.trainer")

# --------------------------------------------------------------------------- HTTP requests


class LossSpec(BaseModel):
    kind: Literal["ppo", "gspo"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


class BatchRef(BaseModel):
    step: int
    group_indices: list[int] | None = None


class ForwardBackward(BatchRef):
    loss: LossSpec | None = None
    eps_low: float = 0.2  # used when `loss` is absent (the request before losses were selectable)
    eps_high: float = 0.2
    old_logprobs: Literal["inference", "trainer"] = "inference"
    num_loss_tokens: int | None = Field(None, gt=0, description="Denominator of the whole optimizer step")


class StepRef(BaseModel):
    step: int


class EndStep(BaseModel):
    step: int  # the outer step whose optimizer steps are all done


class ExportHF(BaseModel):
    uri: str


class Gradients(BaseModel):
    path: str


class WeightConnect(BaseModel):
    host: str
    port: int
    world_size: int
    timeout_s: float


class Broadcast(BaseModel):
    # None: the weights of the last finished step, tagged with that step (``weights_version``);
    # refused while a step is training (a restarted vLLM's re-sync waits for a step boundary).
    version: int | None = None


# ------------------------------------------------------------------------------ dispatcher


class ServiceFailed(RuntimeError):
    """A rank died or a command failed mid-collective: the service cannot continue."""


class _Pending:
    def __init__(self, cmd: dict[str, Any]):
        self.cmd, self.done = cmd, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Dispatcher:
    """Rank 0's queue from HTTP threads to the main thread.

    Invariant: commands run in submission order, one at a time; a caller gets its own command's
    result, or, as soon as a failure is known, an error naming it; never a wait past its deadline.
    """

    def __init__(self, watch: PeerWatch):
        self.watch = watch
        self._queue: queue.Queue[_Pending] = queue.Queue()

    def enqueue(self, cmd: dict[str, Any]) -> _Pending:
        if self.watch.failure:
            raise ServiceFailed(self.watch.failure)
        pending = _Pending(cmd)
        self._queue.put(pending)
        return pending

    def wait(self, pending: _Pending, timeout_s: float) -> Any:
        cmd = pending.cmd
        deadline = time.monotonic() + timeout_s
        while not pending.done.wait(0.05):
            if self.watch.failure:
                raise ServiceFailed(self.watch.failure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {cmd['op']}: no result within {timeout_s:.0f}s")
        if pending.error is not None:
            raise pending.error
        return pending.result

    def next(self, wait_s: float) -> _Pending | None:
        try:
            return self._queue.get(timeout=wait_s)
        except queue.Empty:
            return None


def build_app(token: str, ops: RankOps, trainer: Trainer, dispatcher: Dispatcher, ranks: list[dict], *,
              backend: str, timeout_s: float, storage_options: dict[str, Any], num_steps: int | None = None,
              weights_version: int = 0) -> FastAPI:
    """The HTTP API on rank 0; every route but the metadata, health and end-of-step ones runs a command.

    Rank 0 alone keeps the step state: ``weights_version`` is the outer step whose optimizer steps
    made the current weights (None between a step's first optimizer step and its ``/end_step``);
    ``finished`` is set once, after the end of step ``num_steps`` (the explicit end of training).
    """
    state: dict[str, Any] = {"weights_version": weights_version, "finished": None}
    finished = threading.Event()

    def auth(authorization: str = Header("")) -> None:
        if authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong run token")

    app = FastAPI(title="rollflow trainer", dependencies=[Depends(auth)])

    # Taken around reading or changing the step state and queueing the command that goes with it,
    # so that a broadcast's version tag and an optimizer step are queued in the order they were read.
    order = threading.Lock()

    def queue(op: str, fields: dict[str, Any] | None = None) -> _Pending:
        with _as_http_errors():
            return dispatcher.enqueue({"op": op, **(fields or {})})

    def result(pending: _Pending, deadline_s: float = timeout_s) -> Any:
        with _as_http_errors():
            return dispatcher.wait(pending, deadline_s)

    def run(op: str, fields: dict[str, Any] | None = None, deadline_s: float = timeout_s) -> Any:
        return result(queue(op, fields), deadline_s)

    @app.get("/health")
    def health() -> dict:
        if dispatcher.watch.failure:
            raise HTTPException(503, dispatcher.watch.failure)
        return {"ok": True, "optim_step": trainer.step, "weights_version": state["weights_version"],
                "backend": backend, "world_size": len(ranks), "ranks": ranks, "pid": os.getpid()}

    @app.post("/forward")
    def forward(req: BatchRef) -> dict:
        return run("forward", {"step": req.step, "group_indices": req.group_indices})

    @app.post("/forward_backward")
    def forward_backward(req: ForwardBackward) -> dict:
        loss = req.loss or LossSpec(eps_low=req.eps_low, eps_high=req.eps_high)
        try:
            LossConfig(**loss.model_dump(exclude={"kind"}))
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        if loss.kl_coef > 0 and trainer.reference is None:
            raise HTTPException(400, "loss.kl_coef > 0 needs the reference model, and this trainer was "
                                     "started without one: set train.kl_coef > 0 in the run's config")
        return run("forward_backward", {"step": req.step, "group_indices": req.group_indices, "loss": loss.model_dump(),
                                        "old_logprobs": req.old_logprobs, "num_loss_tokens": req.num_loss_tokens})

    @app.post("/optim_step")
    def optim_step() -> dict:
        if finished.is_set():
            raise HTTPException(409, f"training finished after step {num_steps}: no more optimizer steps")
        with order:
            state["weights_version"] = None
            pending = queue("optim_step")
        return result(pending)

    @app.post("/end_step")
    def end_step(req: EndStep) -> dict:
        """Step ``req.step`` made all its optimizer steps; after the run's last, training ends."""
        with order:  # queued after the step's optimizer steps (the train task calls in order)
            state["weights_version"] = req.step
        if req.step == num_steps and not finished.is_set():
            state["finished"] = {"step": req.step, "optim_step": trainer.step, "time": time.time()}
            finished.set()
            log.info("training finished: step %s, optimizer step %s", req.step, trainer.step)
        return {"finished": finished.is_set()}

    @app.get("/training_finished")
    def training_finished(wait_s: float = 0.0) -> dict:
        """The explicit end of training; a long poll of at most 30 s (calls go on meanwhile)."""
        finished.wait(min(max(wait_s, 0.0), 30.0))
        return {"finished": finished.is_set(), **(state["finished"] or {})}

    @app.post("/save_checkpoint")
    @app.post("/checkpoint")  # the route's earlier name
    def save_checkpoint(req: StepRef) -> dict:
        folder = tempfile.mkdtemp(prefix=f"rollflow-ckpt-{req.step}-")
        return run("save_checkpoint", {"step": req.step, "dir": folder})

    @app.post("/load_checkpoint")
    def load_checkpoint(req: StepRef) -> dict:
        cache = str(Path("~/.cache/rollflow/checkpoints").expanduser())
        return run("load_checkpoint", {"step": req.step, "cache": cache})

    @app.post("/export_hf")
    def export_hf(req: ExportHF) -> dict:
        return run("export_hf", {"uri": req.uri, "storage_options": storage_options})

    @app.post("/gradients")
    def gradients(req: Gradients) -> dict:
        return run("gradients", {"path": req.path})

    @app.get("/weights/metadata")
    def metadata() -> list[dict]:
        return trainer.metadata

    @app.post("/weights/connect")
    def connect(req: WeightConnect) -> dict:
        return run("weights_connect", req.model_dump())

    @app.post("/weights/broadcast")
    def broadcast(req: Broadcast) -> dict:
        if ops.sender is None:
            raise HTTPException(409, "weight group not connected: call /weights/connect first")
        with order:
            version = state["weights_version"] if req.version is None else req.version
            if version is None:
                raise HTTPException(409, "a step is training: its weights are no policy version yet")
            pending = queue("weights_broadcast", {"version": version})
        return {"version": version, **result(pending)}

    @app.post("/weights/close")
    def close_weights() -> dict:
        return run("weights_close")

    @app.post("/shutdown")
    def shutdown() -> dict:
        return run("shutdown", deadline_s=30)

    return app


@contextlib.contextmanager
def _as_http_errors() -> Iterator[None]:
    """A command's failure as the HTTP answer of its route."""
    try:
        yield
    except CommandError as err:
        raise HTTPException(400, str(err)) from None
    except WeightPlaneError as err:  # the inference side of the weight group: 502, still usable
        raise HTTPException(502, str(err)) from None
    except ServiceFailed as err:
        raise HTTPException(503, str(err)) from None
    except TimeoutError as err:
        raise HTTPException(504, str(err)) from None
