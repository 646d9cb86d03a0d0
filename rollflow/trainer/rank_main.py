"""The trainer service: N ranks under torchrun or the deepspeed launcher (one FSDP2 rank on its
own); rank 0 serves HTTP.

Every rank runs ``python -m rollflow.trainer.rank_main ARGS.json`` (started by a launcher, or
alone, see ``services/trainer_process.py``). Rank 0 serves the HTTP API with the run's token; each
call becomes one small JSON command that rank 0's main thread broadcasts over the control group,
and that every rank then runs (``ops.RankOps``). Calls are served one at a time, in order. Training
data never rides the control channel: a command names a committed batch step, and each rank reads
the Parquet itself and takes its own share.

Failure, fast and named: rank 0 watches the other ranks' processes (``control.PeerWatch``). When
a rank dies, the pending call and ``/health`` answer 503 naming it within a fraction of a
second. The launcher then stops the remaining ranks with SIGTERM; rank 0 keeps answering 503 for
``dead_rank_grace_s`` (10 s) before it exits, so that the next call from the run learns which rank died
rather than finding nobody at the address. While idle, rank 0 pings the ranks every
``HEARTBEAT_S``, which keeps their bounded waits for the next command alive.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import uvicorn

from rollflow.infra import network
from rollflow.infra.errors import InputError, ServiceError, WeightSyncError
from rollflow.infra.faults import fault_point
from rollflow.infra.storage import RunStorage
from rollflow.trainer.api import TrainerAPI, build_app
from rollflow.trainer.checkpoints import LOCAL_CHECKPOINTS
from rollflow.trainer.control import ControlGroup, PeerWatch, rank_identity
from rollflow.trainer.dispatch import Dispatcher
from rollflow.trainer.ops import HEARTBEAT, RankOps
from rollflow.trainer.protocol import (
    SAVE_CHECKPOINT,
    SHUTDOWN,
    THREADS_ENV,
    TOKEN_ENV,
    ServiceArgs,
)
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

log = logging.getLogger("rollflow.trainer")

HEARTBEAT_S = 2.0
# Rows of packed sequences on CPU, or the longest sequence if longer: attention costs rows x
# row_tokens^2 (measured on the quickstart's shapes: 32-64 matched padded batches, 256 was ~15%
# slower). None on GPU: one row per micro-batch, flash-attention's varlen kernels.
CPU_ROW_TOKENS = 64


# ------------------------------------------------------------------------------- main loop


def serve(ops: RankOps, dispatcher: Dispatcher | None) -> None:
    """Run commands until ``shutdown``: rank 0 takes them from the dispatcher, the others from rank 0."""
    rank = ops.rank
    saved = None  # the step whose checkpoint this rank's last command saved
    while True:
        pending = None
        if rank == 0:
            if dispatcher.watch.failure:
                return
            pending = dispatcher.next(HEARTBEAT_S)
            cmd = pending.cmd if pending else {"op": HEARTBEAT, "args": {}}
            try:
                ops.control.broadcast(cmd)
            except Exception as err:
                fail = (
                    dispatcher.watch.poll()
                    or f"trainer rank 0 could not reach the other ranks: {err}"
                )
                dispatcher.watch.fail(fail)
                if pending:
                    pending.resolve(error=ServiceError(fail, 503))
                return
        else:
            cmd = ops.control.broadcast()
        if cmd["op"] == SHUTDOWN.op:
            if pending:
                pending.resolve({"ok": True})
            return
        if saved is not None:
            fault_point("after_checkpoint", step=saved)
        saved = cmd["args"]["step"] if cmd["op"] == SAVE_CHECKPOINT.op else None
        try:
            result, error = ops.run(cmd["op"], cmd["args"]), None
        except (InputError, WeightSyncError) as err:  # the ranks are in step: go on
            result, error = None, err
        except Exception as err:
            log.error("command %s failed on rank %d:\n%s", cmd["op"], rank, traceback.format_exc())
            if rank != 0:
                raise
            fail = dispatcher.watch.poll() or f"trainer rank 0: {cmd['op']} failed: {err!r}"
            dispatcher.watch.fail(fail)
            result, error = None, ServiceError(fail, 503)
        if pending:
            pending.resolve(result, error)
        if rank == 0 and dispatcher.watch.failure:
            return


def _init_distributed(args: ServiceArgs) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = args.trainer.device
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    timeout = timedelta(seconds=args.trainer.request_timeout_s)
    # The default group's gloo part (every rank's control and CPU collectives) binds to the
    # interface that reaches MASTER_ADDR, not to what the hostname resolves to (127.0.1.1 on
    # stock Ubuntu, unreachable from another node). A MASTER_ADDR name that itself resolves to
    # loopback here, with ranks on other hosts, fails now rather than at their deadline.
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    if world > local:
        network.check_reachable_name(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    network.bind_gloo_interface()
    # A rank started without a launcher (one FSDP2 rank: trainer_process.launches_directly) is
    # a world of one; its store is in its own memory, so it needs no rendezvous port.
    alone = {}
    if "WORLD_SIZE" not in os.environ:
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl", timeout=timeout, device_id=device, **alone
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo", timeout=timeout, **alone)
    return device


def _threads() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    default = max(1, (os.cpu_count() or 1) // local)
    return int(os.environ.get(THREADS_ENV) or default)


def _reference_path(args: ServiceArgs) -> str | None:
    if not args.needs_reference:
        return None
    if args.reference_model_path:
        return args.reference_model_path
    state = Path(args.model_path) / "trainer" / "state.json"
    if args.checkpoint_step is not None and state.exists():
        recorded = json.loads(state.read_text()).get("reference_model")
        if recorded:
            return recorded
    return args.model_path


def _model_on_this_node(args: ServiceArgs) -> ServiceArgs:
    """Node 0 loads ``model_path``, its own folder; a node on another host, where that folder is
    not, loads a local copy of it from the run's storage (``model_in_storage``), as it does
    checkpoints. (A hub id is no folder: every node loads it from the hub.)"""
    if args.model_in_storage is None or Path(args.model_path).exists():
        return args
    kind, step = args.model_in_storage
    storage = RunStorage(args.storage_root, args.run, args.storage_options)
    log.info(
        "model %s is not on this host: copying %s/step=%d from %s",
        args.model_path,
        kind,
        step,
        storage.uri,
    )
    local = storage.local_copy(kind, step, LOCAL_CHECKPOINTS)
    return args.model_copy(update={"model_path": str(local)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rollflow trainer service (one rank)")
    parser.add_argument(
        "args", help="ServiceArgs: a JSON file, or the JSON itself (another node's command line)"
    )
    parser.add_argument(
        "--local_rank", type=int, default=None, help="set by the deepspeed launcher"
    )
    ns = parser.parse_args(argv)
    text = ns.args if ns.args.lstrip().startswith("{") else Path(ns.args).read_text()
    args = ServiceArgs.model_validate_json(text)
    rank = int(os.environ.get("RANK", 0))
    token = os.environ.get(TOKEN_ENV)
    if not token and rank == 0:  # rank 0 serves the API; the others take commands from it
        sys.exit(f"{TOKEN_ENV} is not set: the trainer refuses to run without the run's token")
    torch.set_num_threads(_threads())
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s"
    )
    args = _model_on_this_node(args)
    device = _init_distributed(args)
    control = ControlGroup(args.trainer.request_timeout_s)
    ranks = control.all_gather(rank_identity())
    spec = TrainerSpec(
        model_path=args.model_path,
        train=args.train,
        trainer=args.trainer,
        sampling=args.sampling,
        seed=args.seed,
        reference_model_path=_reference_path(args),
        weight_dtype=args.weight_dtype,
        num_steps=args.num_steps,
        revision=args.model_revision,
        trust_remote_code=args.trust_remote_code,
    )
    trainer = Trainer(spec, device)
    # Before a checkpoint's optimizer state is loaded: the warm-up leaves the optimizer fresh.
    if (warm_s := trainer.warm_up()) is not None:
        log.info("rank %d: the first step's one-time costs paid in %.2fs", rank, warm_s)
    if args.checkpoint_step is not None:
        trainer.load_checkpoint(args.model_path)
    storage = RunStorage(args.storage_root, args.run, args.storage_options)
    ops = RankOps(
        trainer,
        control,
        storage,
        micro_batch_tokens=args.trainer.micro_batch_tokens,
        row_tokens=None if device.type == "cuda" else CPU_ROW_TOKENS,
    )
    log.info(
        "rank %d/%d ready: %s on %s, %d threads",
        rank,
        len(ranks),
        args.trainer.backend,
        device,
        torch.get_num_threads(),
    )
    if rank != 0:
        serve(ops, None)
    else:
        _serve_rank0(args, token, ops, trainer, ranks)
    log.info("rank %d: shutting down", rank)
    trainer.close()
    dist.destroy_process_group()
    log.info("rank %d: done", rank)


def _serve_rank0(
    args: ServiceArgs, token: str, ops: RankOps, trainer: Trainer, ranks: list[dict]
) -> None:
    hint = f"; see {args.log_path}" if args.log_path else ""
    watch = PeerWatch(ranks, log_hint=hint).start()
    dispatcher = Dispatcher(watch)

    def on_sigterm(signum, frame) -> None:
        # From the launcher after a peer died: linger (the main loop does) so callers learn which.
        if watch.poll() is None:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    api = TrainerAPI(
        ops,
        trainer,
        dispatcher,
        ranks,
        backend=args.trainer.backend,
        timeout_s=args.trainer.request_timeout_s,
        num_steps=args.num_steps,
        weights_version=args.checkpoint_step or 0,
    )
    app = build_app(token, api)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    )

    def serve_http() -> None:
        try:
            server.run()
        finally:  # uvicorn logs why it could not start (a port taken) and ends this thread
            if not server.started:
                log.error("trainer rank 0: no HTTP server on %s:%s; exiting", args.host, args.port)
                os._exit(1)

    threading.Thread(target=serve_http, name="http", daemon=True).start()
    serve(ops, dispatcher)
    if watch.failure:
        log.error(
            "%s; answering 503 for %.0fs, then exiting", watch.failure, args.dead_rank_grace_s
        )
        time.sleep(args.dead_rank_grace_s)
        os._exit(1)
    server.should_exit = True


if __name__ == "__main__":
    main()
