"""Asking a run for N vLLM servers: ``rollflow scale`` and the ``rollflow-scale/fleet``
deployment (the same as a Prefect action: the UI's Run button, ``prefect deployment run``, or
an automation's "run deployment") both call ``infra/vllm_fleet/fleet.scale_run``, which writes
``control/fleet.json`` in the run's storage. This module imports no torch: a worker starts the
flow in seconds.
"""

from __future__ import annotations

from prefect import flow

from rollflow.flows.names import SCALE_FLOW_NAME
from rollflow.infra.vllm_fleet.fleet import scale_run


@flow(
    name=SCALE_FLOW_NAME,
    flow_run_name="{run}: {servers} server(s)",
    persist_result=False,
    log_prints=True,  # what was asked is in the flow run's logs
)
def scale_fleet(run: str, servers: int, storage: str = "runs") -> str:
    """Ask a running run for ``servers`` vLLM servers (as `rollflow scale RUN --servers N`)."""
    done = scale_run(run, servers, storage, by=f"prefect deployment {SCALE_FLOW_NAME}")
    print(done)
    return done
