"""A fake of the Prefect API for the unit tests of processes placed by Prefect (rollflow/services/
placed_server.py, placed_trainer.py): the flow runs the run's side submits, their states, their cancels."""

from __future__ import annotations

import uuid
from types import SimpleNamespace


class FakeFlowRuns:
    """The Prefect API as the run's side sees the flow runs it submits (placed servers, trainer
    nodes): ``run_deployment`` records each submission and gives it a state (``states``, set by
    the test), a cancel makes it CANCELLED."""

    def __init__(self, monkeypatch):
        import prefect.deployments

        from rollflow.services import placed

        self.states: dict[uuid.UUID, str] = {}
        self.submitted: list[dict] = []
        self.cancelled: list[uuid.UUID] = []
        monkeypatch.setattr(prefect.deployments, "run_deployment", self.run_deployment)
        monkeypatch.setattr(placed, "flow_run_state", lambda fid: self.states[fid])
        monkeypatch.setattr(placed, "cancel_flow_run", self.cancel)

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


SECRET_BLOCKS = {"creds": {"key": "planted-key", "secret": "planted-secret"}}


def in_a_placed_flow_run(monkeypatch, module) -> None:
    """A placed flow's body (``module``'s) called as a worker's flow run would run it: a flow run
    context, its log not forwarded, and a Prefect API holding the Secret block ``creds``
    (``SECRET_BLOCKS``); nothing handed over yet in this process's environment."""
    import contextlib

    import prefect.context

    from rollflow.infra import secrets

    monkeypatch.setattr(secrets, "load_secret_block", SECRET_BLOCKS.__getitem__)
    monkeypatch.delenv(secrets.SECRETS_ENV, raising=False)
    monkeypatch.setattr(
        prefect.context,
        "get_run_context",
        lambda: SimpleNamespace(flow_run=SimpleNamespace(id=uuid.uuid4())),
    )
    monkeypatch.setattr(module, "PrefectRunLog", lambda _: contextlib.nullcontext())
