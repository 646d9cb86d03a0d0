"""A fake of the Prefect API for the unit tests of processes placed by Prefect (servers.py,
nodes.py): the flow runs the run's side submits, their states, their cancels."""

from __future__ import annotations

import uuid
from types import SimpleNamespace


class FakeFlowRuns:
    """The Prefect API as the run's side sees the flow runs it submits (placed servers, trainer
    nodes): ``run_deployment`` records each submission and gives it a state (``states``, set by
    the test), a cancel makes it CANCELLED."""

    def __init__(self, monkeypatch):
        import prefect.deployments

        from rollflow.flows import nodes, servers

        self.states: dict[uuid.UUID, str] = {}
        self.submitted: list[dict] = []
        self.cancelled: list[uuid.UUID] = []
        monkeypatch.setattr(prefect.deployments, "run_deployment", self.run_deployment)
        for module in (servers, nodes):  # (nodes: where a flow run's cancel-and-wait reads)
            monkeypatch.setattr(module, "flow_run_state", lambda fid: self.states[fid])
        monkeypatch.setattr(nodes, "cancel_flow_run", self.cancel)

    def run_deployment(self, name, parameters, timeout, work_queue_name, tags, job_variables):
        what = (
            f"vLLM server {parameters['slot']}"
            if "slot" in parameters
            else f"trainer node {parameters['node']}"
        )
        flow_run = SimpleNamespace(id=uuid.uuid4(), name=f"run: {what}")
        self.states[flow_run.id] = "SCHEDULED"
        self.submitted.append(
            {"name": name, "queue": work_queue_name, "job_variables": job_variables, **parameters}
        )
        return flow_run

    def cancel(self, flow_run_id):
        self.cancelled.append(flow_run_id)
        self.states[flow_run_id] = "CANCELLED"
