"""The trainer service: a long-lived process holding the policy, called over HTTP.

Started by the run flow (``python -m rollflow.tasks.train.service``), it outlives every step
flow. Calls are serialised by one lock: the trainer does one thing at a time, in call order.
Training data never rides the control channel: ``forward_backward`` names a committed batch
step in storage, and the service reads the Parquet itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel

from rollflow.infra.storage import RunStorage
from rollflow.infra.weights.group import WeightSender, weight_metadata
from rollflow.tasks.train.trainer import Trainer

log = logging.getLogger("rollflow.trainer")


class ServiceArgs(BaseModel):
    """Everything the service needs at start (passed as one JSON argument)."""

    model_path: str
    checkpoint_step: int | None = None  # load optimizer + trainer state from this checkpoint
    storage_root: str
    storage_options: dict[str, Any] = {}
    run: str
    lr: float
    weight_decay: float
    max_grad_norm: float
    micro_batch_tokens: int
    seed: int = 0
    num_steps: int | None = None  # the run's last outer step: training_finished follows it
    host: str = "127.0.0.1"
    port: int


class ForwardBackward(BaseModel):
    step: int
    group_indices: list[int] | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2


class EndStep(BaseModel):
    step: int  # the outer step whose optimizer steps are all done


class WeightConnect(BaseModel):
    host: str
    port: int
    world_size: int
    timeout_s: float


class Broadcast(BaseModel):
    # None: the weights of the last finished step, tagged with that step (``weights_version``);
    # refused while a step is training (a restarted vLLM's re-sync waits for a step boundary).
    version: int | None = None


class SaveCheckpoint(BaseModel):
    step: int


def build_app(args: ServiceArgs, token: str) -> FastAPI:
    storage = RunStorage(args.storage_root, args.run, args.storage_options)
    trainer = Trainer(args.model_path, lr=args.lr, weight_decay=args.weight_decay,
                      max_grad_norm=args.max_grad_norm, micro_batch_tokens=args.micro_batch_tokens,
                      seed=args.seed)
    if args.checkpoint_step is not None:
        trainer.load_checkpoint(args.model_path)
    lock = threading.Lock()
    # weights_version: the outer step whose optimizer steps made the current weights; None
    # between a step's first optimizer step and its /end_step.
    state: dict[str, Any] = {"sender": None, "batch_step": None, "batch": None, "finished": None,
                             "weights_version": args.checkpoint_step or 0}
    finished = threading.Event()  # set once, after the optimizer step that ends training

    def auth(authorization: str = Header("")) -> None:
        if authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong run token")

    app = FastAPI(title="rollflow trainer", dependencies=[Depends(auth)])

    def batch_rows(step: int, groups: list[int] | None) -> list[dict]:
        if state["batch_step"] != step:
            state["batch"], state["batch_step"] = storage.read_step_table("batches", step), step
        table = state["batch"]
        if groups is not None:
            table = table.filter(pc.is_in(table["group_index"], value_set=pa.array(groups, type=pa.int32())))
        return table.select(["prompt_ids", "completion_ids", "completion_logprobs", "advantage"]).to_pylist()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True, "optim_step": trainer.step, "weights_version": state["weights_version"],
                "pid": os.getpid()}

    @app.post("/forward_backward")
    def forward_backward(req: ForwardBackward) -> dict:
        with lock:
            rows = batch_rows(req.step, req.group_indices)
            if not rows:
                raise HTTPException(400, f"batch step={req.step} has no rows for groups {req.group_indices}")
            total = sum(len(r["completion_ids"]) for r in rows)
            return trainer.forward_backward(rows, total_loss_tokens=total, eps_low=req.eps_low,
                                            eps_high=req.eps_high)

    @app.post("/optim_step")
    def optim_step() -> dict:
        with lock:
            if finished.is_set():
                raise HTTPException(409, f"training finished after step {args.num_steps}: "
                                         "no more optimizer steps")
            state["weights_version"] = None
            return trainer.optim_step()

    @app.post("/end_step")
    def end_step(req: EndStep) -> dict:
        """Step ``req.step`` made all its optimizer steps; after the run's last, training ends."""
        with lock:
            state["weights_version"] = req.step
            if req.step == args.num_steps and not finished.is_set():
                state["finished"] = {"step": req.step, "optim_step": trainer.step, "time": time.time()}
                finished.set()
                log.info("training finished: step %s, optimizer step %s", req.step, trainer.step)
            return {"finished": finished.is_set()}

    @app.get("/training_finished")
    def training_finished(wait_s: float = 0.0) -> dict:
        """The explicit end of training; a long poll of at most 30 s (no lock: calls go on)."""
        finished.wait(min(max(wait_s, 0.0), 30.0))
        return {"finished": finished.is_set(), **(state["finished"] or {})}

    @app.post("/checkpoint")
    def checkpoint(req: SaveCheckpoint) -> dict:
        with lock:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="rollflow-ckpt-") as tmp:
                trainer.save_checkpoint(tmp)
                uri = storage.upload_dir(tmp, "checkpoints", req.step)
            return {"uri": uri, "checkpoint_s": time.perf_counter() - start}

    @app.get("/weights/metadata")
    def metadata() -> list[dict]:
        return weight_metadata(trainer.named_weights())

    @app.post("/weights/connect")
    def connect(req: WeightConnect) -> dict:
        with lock:
            if state["sender"] is not None:
                state["sender"].close()
            sender = WeightSender(req.host, req.port, req.world_size, req.timeout_s)
            sender.connect()
            state["sender"] = sender
            return {"ok": True}

    @app.post("/weights/broadcast")
    def broadcast(req: Broadcast) -> dict:
        with lock:
            if state["sender"] is None:
                raise HTTPException(409, "weight group not connected: call /weights/connect first")
            version = state["weights_version"] if req.version is None else req.version
            if version is None:
                raise HTTPException(409, "a step is training: its weights are no policy version yet")
            start = time.perf_counter()
            with torch.no_grad():
                num_bytes = state["sender"].broadcast(trainer.named_weights(), version)
            return {"version": version, "bytes": num_bytes, "broadcast_s": time.perf_counter() - start}

    @app.post("/weights/close")
    def close_weights() -> dict:
        with lock:
            if state["sender"] is not None:
                state["sender"].close()
                state["sender"] = None
            return {"ok": True}

    @app.post("/shutdown")
    def shutdown() -> dict:
        threading.Timer(0.1, lambda: os._exit(0)).start()
        return {"ok": True}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rollflow trainer service")
    parser.add_argument("args_json", help="ServiceArgs as JSON")
    ns = parser.parse_args(argv)
    args = ServiceArgs.model_validate(json.loads(ns.args_json))
    token = os.environ.get("ROLLFLOW_TOKEN")
    if not token:
        sys.exit("ROLLFLOW_TOKEN is not set: the trainer refuses to run without the run's token")
    torch.set_num_threads(int(os.environ.get("ROLLFLOW_TRAINER_THREADS", torch.get_num_threads())))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    app = build_app(args, token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
