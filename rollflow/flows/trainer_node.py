"""A trainer node as a Prefect flow run: the body a worker on the node's host runs.

The flow run is the node. Its body starts the node's launcher under the ``ManagedProcess``
guard, on its main thread, so a cancelled or crashed flow run takes the node's ranks with it;
it says the node's log lines in the flow run's log (the UI's Logs tab; ``PrefectRunLog``), and
it ends with the node: Completed when the launcher exits 0 (the run's trainer ended), Failed
naming the exit code and the log's last lines otherwise. Everything the node needs travels in
its parameters (the trainer's arguments, and how many of its host's GPUs it takes) and the run's
object storage (the policy, checkpoints): no shared file system. The node makes its launcher
command on its host, where its devices are known: its GPUs are the first of its host's own
``CUDA_VISIBLE_DEVICES`` (a worker given ``4,5,6,7``: 4 and 5 for two ranks), never the run's
host's (``placement.devices_on_this_host``); the command is the one the run prints for a node
placed by hand, the devices named. A node whose run's flow run ended (its host lost: marked
Crashed) stops with it (``DriverWatch``).

Node 0 serves the trainer's API: its body starts its own launcher, bound to the address its
host reaches the run's host from, and writes where it serves and where the other nodes meet it
(``trainer.master_addr``, ``auto``: that address) to the run's storage (``NODE_0_FILE``), which
the run waits for (``services/placed_trainer.py``).

Which host takes which node: a deployment's pool, and a work queue per node where the config
names them (``trainer.node_queues``): a process pool on bare hosts has a queue per host, each
host's worker started with ``--work-queue``; a Kubernetes or Docker pool places the job itself.
This module imports no torch: a worker starts the flow in seconds.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow

from rollflow.flows.names import NODE_FLOW_NAME
from rollflow.infra.processes import ManagedProcess
from rollflow.infra.secrets import hand_over_secret_block
from rollflow.infra.terminal import PrefectRunLog, say
from rollflow.services.placed import (
    NODE_0_FILE,
    DriverWatch,
    follow_to_its_end,
)


@flow(
    name=NODE_FLOW_NAME,
    flow_run_name="{run}: trainer node {node}",
    persist_result=False,
    validate_parameters=False,
)
def trainer_node(
    run: str,
    node: int,
    args: str,
    gpus: list[int] | None = None,
    serve: dict[str, Any] | None = None,
    driver: str | None = None,
    storage_secret: list[str] | None = None,
) -> dict:
    """Run trainer node ``node`` of run ``run`` to its end: its launcher made here from the
    trainer's arguments ``args`` (``ServiceArgs`` as JSON), on ``gpus`` (positions in this host's
    ``CUDA_VISIBLE_DEVICES``; none on CPU); node 0 (``serve``: ``PlacedTrainer``'s settings)
    serves the trainer's API. ``driver``: the run's flow run, whose end ends the node
    (``DriverWatch``). ``storage_secret``: the run's storage root and ``run.storage_secret``, the
    Secret block this flow run loads the storage's credentials from (its ranks inherit them)."""
    from prefect.context import get_run_context

    flow_run_id = get_run_context().flow_run.id
    if storage_secret:
        hand_over_secret_block(*storage_secret)
    watch = DriverWatch(driver)
    with PrefectRunLog(flow_run_id):
        if serve is not None:
            return _serve_node_0(run, args, gpus or [], serve, flow_run_id, watch)
        from rollflow.services.trainer_process import node_command

        argv, env = node_command(args, node, gpus or [])
        return _run_node(run, node, argv, env, watch)


def _serve_node_0(
    run: str,
    args_json: str,
    gpus: list[int],
    serve: dict[str, Any],
    flow_run_id,
    watch: DriverWatch,
) -> dict:
    """Node 0's body: its launcher on ``gpus`` of this host's list, bound to the address its
    host reaches the run's host from (``serve["reach"]``), ``trainer.master_addr = "auto"`` made
    that address; where it serves and meets the other nodes written to the run's storage
    (``NODE_0_FILE``) before it starts; its log said line by line, to its end."""
    from rollflow.infra.network import route_source
    from rollflow.infra.placement import devices_on_this_host
    from rollflow.infra.processes import free_port
    from rollflow.infra.storage import RunStorage
    from rollflow.services.placed import read_key
    from rollflow.services.trainer_process import TrainerProcess
    from rollflow.trainer.protocol import ServiceArgs

    storage = RunStorage(serve["storage"], run, serve.get("storage_options") or {})
    device_env = devices_on_this_host(gpus)  # before anything starts: a host short of GPUs fails
    address = route_source(serve["reach"])
    args = ServiceArgs.model_validate_json(args_json)
    tr = args.trainer
    if tr.master_addr == "auto":
        tr = tr.model_copy(update={"master_addr": address})
    args = args.model_copy(update={"trainer": tr, "host": address, "port": free_port(address)})
    log_dir = Path(tempfile.mkdtemp(prefix=f"rollflow-{run}-node-0-"))
    trainer = TrainerProcess(
        args,
        token=read_key(storage),
        log_dir=log_dir,
        device_env=device_env,
        cpus=tuple(serve.get("cpus") or ()),
        progress=say,
    )
    where = {
        "flow_run_id": str(flow_run_id),
        "url": trainer.endpoint.url,
        "master_addr": tr.master_addr,
        "started_at": time.time(),
    }
    storage.write_json(NODE_0_FILE, where)
    say(
        f"trainer node 0 of run {run}: serving at {trainer.endpoint.url}, the other nodes meet it "
        f"at {tr.master_addr}; its log on this host: {trainer.process.log_path}"
    )
    trainer.start()
    code = follow_to_its_end(trainer.process, f"trainer node 0 of run {run}", watch)
    say(f"trainer node 0 of run {run}: ended with the run's trainer")
    return {"run": run, "node": 0, "url": trainer.endpoint.url, "exit_code": code}


def _run_node(
    run: str,
    node: int,
    argv: list[str],
    env: dict[str, str] | None = None,
    watch: DriverWatch | None = None,
) -> dict:
    """The node's launcher under the guard, each of its log lines said (``say``: the flow run's
    log and the worker's output), to its end."""
    log_path = Path(tempfile.mkdtemp(prefix=f"rollflow-{run}-node-{node}-")) / "trainer-node.log"
    proc = ManagedProcess(f"trainer-node-{node}", argv, log_path, env=env)
    say(f"trainer node {node} of run {run}: starting; its log on this host: {log_path}")
    proc.start()
    code = follow_to_its_end(proc, f"trainer node {node} of run {run}", watch)
    say(f"trainer node {node} of run {run}: ended with the run's trainer")
    return {"run": run, "node": node, "exit_code": code}
