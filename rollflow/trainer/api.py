"""The trainer's HTTP API on rank 0, and the dispatcher that hands each call to the main thread.

Every route but ``/health`` and ``/weights/metadata`` becomes one JSON command for the main
thread, which runs it on every rank (``service.serve``). A route answers 400 for bad input found
before any collective (``InputError``), 409 for a call out of turn, 502 when the weight plane
failed (``WeightSyncError``), 503 once a rank died or a command failed
mid-collective, 504 past the call's deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rollflow.infra.errors import InputError, ServiceError, WeightSyncError
from rollflow.trainer.control import PeerWatch
from rollflow.trainer.ops import RankOps
from rollflow.trainer.protocol import (
    BatchRef,
    Broadcast,
    ExportHF,
    ForwardBackward,
    Gradients,
    StepRef,
    WeightConnect,
)
from rollflow.trainer.trainer import Trainer

log = logging.getLogger("rollflow.trainer")

# ------------------------------------------------------------------------------ dispatcher


class _Pending:
    def __init__(self, cmd: dict[str, Any]):
        self.cmd, self.done = cmd, threading.Event()  # {"op": name, "args": the request's JSON}
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
            raise ServiceError(self.watch.failure, 503)
        pending = _Pending(cmd)
        self._queue.put(pending)
        return pending

    def wait(self, pending: _Pending, timeout_s: float) -> Any:
        cmd = pending.cmd
        deadline = time.monotonic() + timeout_s
        while not pending.done.wait(0.05):
            if self.watch.failure:
                raise ServiceError(self.watch.failure, 503)
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


def build_app(
    token: str,
    ops: RankOps,
    trainer: Trainer,
    dispatcher: Dispatcher,
    ranks: list[dict],
    *,
    backend: str,
    timeout_s: float,
    num_steps: int | None = None,
    weights_version: int = 0,
) -> FastAPI:
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

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A malformed body is bad input like any other: 400, naming each field and what is wrong."""
        problems = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse(
            {"detail": f"{request.url.path}: " + "; ".join(problems)}, status_code=400
        )

    # Taken around reading or changing the step state and queueing the command that goes with it,
    # so that a broadcast's version tag and an optimizer step are queued in the order they were read.
    order = threading.Lock()

    def queue(op: str, request: BaseModel | None = None) -> _Pending:
        args = request.model_dump(mode="json") if request is not None else {}
        with _as_http_errors():
            return dispatcher.enqueue({"op": op, "args": args})

    def result(pending: _Pending, deadline_s: float = timeout_s) -> Any:
        with _as_http_errors():
            return dispatcher.wait(pending, deadline_s)

    def run(op: str, request: BaseModel | None = None, deadline_s: float = timeout_s) -> Any:
        return result(queue(op, request), deadline_s)

    @app.get("/health")
    def health() -> dict:
        if dispatcher.watch.failure:
            raise HTTPException(503, dispatcher.watch.failure)
        return {
            "ok": True,
            "optim_step": trainer.step,
            "weights_version": state["weights_version"],
            "backend": backend,
            "world_size": len(ranks),
            "ranks": ranks,
            "pid": os.getpid(),
        }

    @app.post("/forward")
    def forward(req: BatchRef) -> dict:
        return run("forward", req)

    @app.post("/forward_backward")
    def forward_backward(req: ForwardBackward) -> dict:
        if req.loss.kl_coef > 0 and trainer.reference is None:
            raise HTTPException(
                400,
                "loss.kl_coef > 0 needs the reference model, and this trainer was "
                "started without one: set train.loss.kl_coef > 0 in the run's config",
            )
        return run("forward_backward", req)

    @app.post("/optim_step")
    def optim_step() -> dict:
        if finished.is_set():
            raise HTTPException(
                409, f"training finished after step {num_steps}: no more optimizer steps"
            )
        with order:
            state["weights_version"] = None
            pending = queue("optim_step")
        return result(pending)

    @app.post("/end_step")
    def end_step(req: StepRef) -> dict:
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
    def save_checkpoint(req: StepRef) -> dict:
        return run("save_checkpoint", req)

    @app.post("/load_checkpoint")
    def load_checkpoint(req: StepRef) -> dict:
        return run("load_checkpoint", req)

    @app.post("/export_hf")
    def export_hf(req: ExportHF) -> dict:
        return run("export_hf", req)

    @app.post("/gradients")
    def gradients(req: Gradients) -> dict:
        return run("gradients", req)

    @app.get("/weights/metadata")
    def metadata() -> list[dict]:
        return trainer.metadata

    @app.post("/weights/connect")
    def connect(req: WeightConnect) -> dict:
        return run("weights_connect", req)

    def queue_tagged(op: str, version: int | None) -> tuple[int, _Pending]:
        """Queue a weight-plane command for ``version`` (None: the last finished step's), in
        order after the calls before it; 409 while a step is training (no version yet)."""
        with order:
            version = state["weights_version"] if version is None else version
            if version is None:
                raise HTTPException(
                    409, "a step is training: its weights are no policy version yet"
                )
            return version, queue(op, Broadcast(version=version))

    @app.post("/weights/capture")
    def capture(req: Broadcast) -> dict:
        """Keep the current weights as ``req.version`` (default: the last finished step's) for a
        later ``/weights/broadcast`` of that version, which then leaves the ranks free to train."""
        _, pending = queue_tagged("weights_capture", req.version)
        return result(pending)

    @app.post("/weights/broadcast")
    def broadcast(req: Broadcast) -> dict:
        if ops.sender is None:
            raise HTTPException(409, "weight group not connected: call /weights/connect first")
        if req.version is not None:
            # Captured at the end of its step: sent from this thread while the ranks go on.
            with _as_http_errors():
                sent = ops.send_captured(req.version)
            if sent is not None:
                return {"version": req.version, **sent}
        version, pending = queue_tagged("weights_broadcast", req.version)
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
    except InputError as err:
        raise HTTPException(400, str(err)) from None
    except WeightSyncError as err:  # the inference side of the weight group: 502, still usable
        raise HTTPException(502, str(err)) from None
    except ServiceError as err:  # a rank died or a command failed mid-collective: 503 from now on
        raise HTTPException(503, str(err)) from None
    except TimeoutError as err:
        raise HTTPException(504, str(err)) from None
