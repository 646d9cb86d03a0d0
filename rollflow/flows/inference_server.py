"""A vLLM server as a Prefect flow run: the body a worker on the server's host runs.

The flow run is the server. Its body loads the policy from the run's storage (no shared file
system), starts vLLM under the ``ManagedProcess`` guard on its main thread (a cancelled or
crashed flow run takes vLLM with it), bound to the address its host reaches the run's host from,
says vLLM's log lines in the flow run's log, and ends with vLLM: Completed on exit 0, Failed
naming the exit code otherwise. Before vLLM starts it writes where it serves
(``control/servers/<slot>.json``: its flow run, URL) to the run's storage, which is how the run
(``services/placed_server.py``) finds it. The server's key (every vLLM route's, and the weight
group's secret) is not a parameter, which the Prefect UI shows: it is read from the run's
storage, written there by the run for its lifetime (``services/placed.py``). Its GPUs are the
first of its host's own ``CUDA_VISIBLE_DEVICES`` (``server["gpus"]``: positions in that list,
``placement.devices_on_this_host``), never the run's host's.
This module imports no torch: a worker starts the flow in seconds.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow

from rollflow.flows.names import SERVER_FLOW_NAME
from rollflow.infra.secrets import hand_over_secret_block
from rollflow.infra.storage import LOCAL_CHECKPOINTS, RunStorage
from rollflow.infra.terminal import PrefectRunLog, say
from rollflow.services.placed import (
    DriverWatch,
    follow_to_its_end,
    read_key,
    slot_file,
)


@flow(
    name=SERVER_FLOW_NAME,
    flow_run_name="{run}: vLLM server {slot}",
    persist_result=False,
    validate_parameters=False,
)
def inference_server(
    run: str,
    slot: int,
    storage: str,
    storage_options: dict[str, Any],
    model: tuple[str, int],
    server: dict[str, Any],
    driver: str | None = None,
    storage_secret: str | None = None,
) -> dict:
    """Serve vLLM server ``slot`` of run ``run``, loading ``model`` (kind, step) from the run's
    ``storage``, with ``server``'s settings (``PlacedServer.settings``), until vLLM ends or the
    run's flow run ``driver`` does (``nodes.DriverWatch``). ``storage_secret``: the run's
    ``run.storage_secret``, the Secret block this flow run loads the storage's credentials from."""
    from prefect.context import get_run_context

    flow_run_id = get_run_context().flow_run.id
    hand_over_secret_block(storage, storage_secret)
    with PrefectRunLog(flow_run_id):
        return serve(
            run,
            slot,
            RunStorage(storage, run, storage_options),
            model,
            server,
            flow_run_id,
            DriverWatch(driver),
        )


def serve(
    run: str,
    slot: int,
    storage: RunStorage,
    model: tuple[str, int],
    settings: dict[str, Any],
    flow_run_id: UUID | str,
    watch: DriverWatch | None = None,
) -> dict:
    """The flow's body: the policy copied here, vLLM started under the guard on this host's
    address toward the run's host, where it serves written to the run's storage, its log said
    line by line, to its end."""
    from rollflow.infra.network import route_source
    from rollflow.infra.placement import devices_on_this_host
    from rollflow.infra.processes import free_port
    from rollflow.services.vllm_server import InferenceServer

    key = read_key(storage)
    # this host's GPUs, not the run's host's; a host short of them fails before anything starts
    env = {**(settings.get("env") or {}), **devices_on_this_host(settings.get("gpus") or ())}
    address = route_source(settings["reach"])  # as the run's host reaches this host
    port = settings.get("port") or free_port(address)
    kind, step = model
    say(f"vLLM server {slot} of run {run}: copying {kind}/step={step} from {storage.uri}")
    model_dir = storage.local_copy(kind, step, LOCAL_CHECKPOINTS)
    log_path = Path(tempfile.mkdtemp(prefix=f"rollflow-{run}-vllm-{slot}-")) / "vllm.log"
    server = InferenceServer(
        model_dir,
        host=address,
        port=port,
        max_model_len=settings.get("max_model_len"),
        startup_timeout_s=settings["startup_timeout_s"],
        extra_args=settings.get("extra_args") or [],
        extra_env=env,
        log_path=log_path,
        api_key=key,
        cpus=tuple(settings.get("cpus") or ()),
    )
    where = {"flow_run_id": str(flow_run_id), "url": server.url, "started_at": time.time()}
    storage.write_json(slot_file(slot), where)
    say(f"vLLM server {slot} of run {run}: starting at {server.url}; its log here: {log_path}")
    server.spawn()
    try:
        code = follow_to_its_end(server.process, f"vLLM server {slot} of run {run}", watch)
    finally:
        server.stop()  # and its LoRA folder, were there one
    say(f"vLLM server {slot} of run {run}: ended")
    return {"run": run, "slot": slot, "url": server.url, "exit_code": code}
