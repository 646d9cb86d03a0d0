"""The trainer's HTTP API on rank 0: one method per route of ``protocol.ROUTES``, beside its body.

What a route answers is held to its reply model (``route.reply_json``) before it leaves: a reply
that drifts from the contract is a 500 naming the field, here, not a missing key in the caller.

A command route (``route.command``) becomes one JSON command for the main thread, which runs it
on every rank (``service.serve``); the others (health, metadata, the end of a step and of
training) rank 0 answers alone. Every route needs the run's token, and nothing else is served
(no ``/docs`` or ``/openapi.json``). A route answers 400 for bad input found before any
collective (``InputError``), 401 without the token, 409 for a call out of turn, 502 when the
weight plane failed (``WeightSyncError``), 503 once a rank died or a command failed
mid-collective, 504 past the call's deadline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from rollflow.infra.errors import InputError, ServiceError, WeightSyncError
from rollflow.infra.processes import free_port
from rollflow.trainer import protocol as p
from rollflow.trainer.dispatch import Dispatcher, Pending
from rollflow.trainer.ops import RankOps
from rollflow.trainer.protocol import (
    BatchRef,
    Broadcast,
    ExportHF,
    ForwardBackward,
    Gradients,
    Route,
    StepRef,
    WeightConnect,
)
from rollflow.trainer.rank_trainer import Trainer
from rollflow.trainer.weight_plane import NOT_CONNECTED

log = logging.getLogger("rollflow.trainer")


def serves(route: Route) -> Callable[[Callable], Callable]:
    """Mark a method of ``TrainerAPI`` as the handler of ``route``."""

    def mark(handler: Callable) -> Callable:
        handler.route = route  # type: ignore[attr-defined]
        return handler

    return mark


class TrainerAPI:
    """Rank 0's routes.

    Owns the step state, which rank 0 alone keeps: ``weights_version`` is the outer step whose
    optimizer steps made the current weights (None between a step's first optimizer step and its
    ``/end_step``); ``finished`` is set once, after the end of step ``num_steps`` (the explicit
    end of training).
    """

    def __init__(
        self,
        ops: RankOps,
        trainer: Trainer,
        dispatcher: Dispatcher,
        ranks: list[dict],
        *,
        backend: str,
        timeout_s: float,
        num_steps: int | None = None,
        weights_version: int = 0,
    ):
        self.ops, self.trainer, self.dispatcher, self.ranks = ops, trainer, dispatcher, ranks
        self.backend, self.timeout_s, self.num_steps = backend, timeout_s, num_steps
        self.weights_version: int | None = weights_version
        self.finished = threading.Event()
        self.finished_at: dict[str, Any] = {}
        if num_steps is not None and weights_version >= num_steps:
            # Restarted from the run's last checkpoint (a node lost after the last step
            # committed): no step is left to end, so the end is said at once. Left unsaid, the
            # run waited for it until its deadline and failed (seen in the two-host run).
            self._finish(weights_version)
        # Taken around reading or changing the step state and queueing the command that goes
        # with it, so that a broadcast's version tag and an optimizer step are queued in the
        # order they were read.
        self.order = threading.Lock()

    def routes(self) -> list[tuple[Route, Callable]]:
        """Every route with its bound handler, in the order declared below."""
        marked = [f for f in vars(type(self)).values() if hasattr(f, "route")]
        return [(f.route, getattr(self, f.__name__)) for f in marked]

    # ------------------------------------------------------------------- commands

    def _queue(self, route: Route, request: BaseModel | None = None) -> Pending:
        args = request.model_dump(mode="json") if request is not None else {}
        with _as_http_errors():
            return self.dispatcher.enqueue({"op": route.op, "args": args})

    def _result(self, pending: Pending, deadline_s: float | None = None) -> Any:
        with _as_http_errors():
            return self.dispatcher.wait(pending, deadline_s or self.timeout_s)

    def _run(
        self, route: Route, request: BaseModel | None = None, deadline_s: float | None = None
    ) -> Any:
        return self._result(self._queue(route, request), deadline_s)

    def _queue_tagged(
        self, route: Route, version: int | None, wait_s: float = 0.0
    ) -> tuple[int, Pending]:
        """Queue a weight-plane command for ``version`` (None: the last finished step's), in
        order after the calls before it. While a step is training (no version yet) wait up to
        ``wait_s`` for its end, then 409: checked and queued under the step state's lock, so
        the command runs at a step boundary, before any later optimizer step (a re-join read
        the version between steps and met the next step's first optimizer step)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.order:
                tagged = self.weights_version if version is None else version
                if tagged is not None:
                    return tagged, self._queue(route, Broadcast(version=tagged))
            if time.monotonic() >= deadline:
                raise HTTPException(
                    409, "a step is training: its weights are no policy version yet"
                )
            time.sleep(0.05)

    # --------------------------------------------------------------------- routes

    @serves(p.HEALTH)
    def health(self) -> dict:
        if self.dispatcher.watch.failure:
            raise HTTPException(503, self.dispatcher.watch.failure)
        return {
            "ok": True,
            "optim_step": self.trainer.step,
            "weights_version": self.weights_version,
            "backend": self.backend,
            "world_size": len(self.ranks),
            "ranks": self.ranks,
            "pid": os.getpid(),
        }

    @serves(p.FORWARD)
    def forward(self, req: BatchRef) -> dict:
        return self._run(p.FORWARD, req)

    @serves(p.FORWARD_BACKWARD)
    def forward_backward(self, req: ForwardBackward) -> dict:
        if req.loss.kl_coef > 0 and self.trainer.reference is None:
            raise HTTPException(
                400,
                "loss.kl_coef > 0 needs the reference model, and this trainer was "
                "started without one: set train.loss.kl_coef > 0 in the run's config",
            )
        return self._run(p.FORWARD_BACKWARD, req)

    @serves(p.OPTIM_STEP)
    def optim_step(self) -> dict:
        if self.finished.is_set():
            raise HTTPException(
                409, f"training finished after step {self.num_steps}: no more optimizer steps"
            )
        with self.order:
            self.weights_version = None
            pending = self._queue(p.OPTIM_STEP)
        return self._result(pending)

    @serves(p.END_STEP)
    def end_step(self, req: StepRef) -> dict:
        """Step ``req.step`` made all its optimizer steps; after the run's last, training ends."""
        with self.order:  # queued after the step's optimizer steps (the train task calls in order)
            self.weights_version = req.step
        if req.step == self.num_steps and not self.finished.is_set():
            self._finish(req.step)
            log.info("training finished: step %s, optimizer step %s", req.step, self.trainer.step)
        return {"finished": self.finished.is_set()}

    def _finish(self, step: int) -> None:
        """Say the end of training, after ``step``: ``training_finished`` answers it."""
        self.finished_at = {"step": step, "optim_step": self.trainer.step, "time": time.time()}
        self.finished.set()

    @serves(p.TRAINING_FINISHED)
    def training_finished(self, wait_s: float = 0.0) -> dict:
        """The explicit end of training; a long poll of at most 30 s (calls go on meanwhile)."""
        self.finished.wait(min(max(wait_s, 0.0), 30.0))
        return {"finished": self.finished.is_set(), **self.finished_at}

    @serves(p.SAVE_CHECKPOINT)
    def save_checkpoint(self, req: StepRef) -> dict:
        return self._run(p.SAVE_CHECKPOINT, req)

    @serves(p.LOAD_CHECKPOINT)
    def load_checkpoint(self, req: StepRef) -> dict:
        return self._run(p.LOAD_CHECKPOINT, req)

    @serves(p.EXPORT_HF)
    def export_hf(self, req: ExportHF) -> dict:
        return self._run(p.EXPORT_HF, req)

    @serves(p.GRADIENTS)
    def gradients(self, req: Gradients) -> dict:
        return self._run(p.GRADIENTS, req)

    @serves(p.WEIGHTS_METADATA)
    def metadata(self) -> list[dict]:
        return self.trainer.metadata

    @serves(p.WEIGHTS_PORT)
    def weights_port(self) -> dict:
        # On every interface: the store listens on all of them, whatever name the group meets at.
        return {"port": free_port("0.0.0.0")}

    @serves(p.WEIGHTS_CONNECT)
    def connect(self, req: WeightConnect) -> dict:
        return self._run(p.WEIGHTS_CONNECT, req)

    @serves(p.WEIGHTS_CAPTURE)
    def capture(self, req: Broadcast) -> dict:
        """Keep the current weights as ``req.version`` (default: the last finished step's) for a
        later broadcast of that version, which then leaves the ranks free to train."""
        _, pending = self._queue_tagged(p.WEIGHTS_CAPTURE, req.version)
        return self._result(pending)

    @serves(p.WEIGHTS_BROADCAST)
    def broadcast(self, req: Broadcast) -> dict:
        if not self.ops.weights.connected:
            raise HTTPException(409, NOT_CONNECTED)
        if req.version is not None:
            # Captured at the end of its step: sent from this thread while the ranks go on.
            with _as_http_errors():
                sent = self.ops.weights.send_captured(req.version)
            if sent is not None:
                return {"version": req.version, **sent}
        version, pending = self._queue_tagged(p.WEIGHTS_BROADCAST, req.version, req.wait_s)
        return {"version": version, **self._result(pending)}

    @serves(p.WEIGHTS_CLOSE)
    def close_weights(self) -> dict:
        return self._run(p.WEIGHTS_CLOSE)

    @serves(p.SHUTDOWN)
    def shutdown(self) -> dict:
        return self._run(p.SHUTDOWN, deadline_s=30)


def build_app(token: str, api: TrainerAPI) -> FastAPI:
    """The HTTP app of ``api``: each of its routes, all behind the run's token, and nothing else."""

    def auth(authorization: str = Header("")) -> None:
        if authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong run token")

    # FastAPI's /docs, /redoc and /openapi.json would answer without the token: not served.
    app = FastAPI(
        title="rollflow trainer",
        dependencies=[Depends(auth)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A malformed body is bad input like any other: 400, naming each field and what is wrong."""
        problems = [f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse(
            {"detail": f"{request.url.path}: " + "; ".join(problems)}, status_code=400
        )

    routes = api.routes()
    unserved = sorted(r.path for r in set(p.ROUTES) - {r for r, _ in routes})
    assert not unserved and len(routes) == len(p.ROUTES), f"routes without a handler: {unserved}"
    for route, handler in routes:
        # The reply is shaped by the route's model (``_replying``), not by the return annotation.
        app.add_api_route(
            route.path, _replying(route, handler), methods=[route.method], response_model=None
        )
    return app


def _replying(route: Route, handler: Callable) -> Callable:
    """``handler`` answering what it returns held to ``route.reply`` (the keys it gave)."""

    @functools.wraps(handler)  # FastAPI reads the handler's parameters through it
    def answer(*args: Any, **kwargs: Any) -> Any:
        reply = handler(*args, **kwargs)
        try:
            return route.reply_json(reply)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e['loc']) or '(reply)'}: {e['msg']}"
                for e in err.errors()
            )
            log.error("%s answered a reply that does not fit its model: %s", route.path, problems)
            raise HTTPException(
                500, f"{route.path}: the trainer's reply does not fit its model: {problems}"
            ) from None

    return answer


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
