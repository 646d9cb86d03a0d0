"""The heal automations' definitions and the rerun count (the chain itself runs on a real
Prefect server in tests/integration/flows/test_deployment.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import StateType

from rollflow.flows.heal import (
    RERUN_AUTOMATION,
    SILENT_AUTOMATION,
    heal_automations,
    reruns_of,
)


def test_the_rerun_count_follows_the_chain_of_reruns():
    assert reruns_of(["rollflow", "cpu"]) == 0
    assert reruns_of(["rollflow-rerun:2", "rollflow-rerun-of:abc"]) == 2
    assert reruns_of(["rollflow-rerun:x"]) == 0  # a hand-made tag counts for nothing


def test_a_crashed_run_flow_run_is_rerun_and_a_silent_one_is_crashed():
    heal = uuid4()
    rerun, silent = heal_automations(heal, heartbeat_s=30)
    assert rerun.name == RERUN_AUTOMATION and silent.name == SILENT_AUTOMATION
    # Only rl-run flow runs: a step flow run or another flow crashing is not a lost run.
    for automation in (rerun, silent):
        related = automation.trigger.match_related
        related = related[0] if isinstance(related, list) else related
        assert related.root == {"prefect.resource.role": "flow", "prefect.resource.name": "rl-run"}
    assert rerun.trigger.expect == {"prefect.flow-run.Crashed"}
    (action,) = rerun.actions
    assert action.deployment_id == heal and action.parameters == {
        "flow_run_id": "{{ event.resource.id }}"
    }
    assert silent.trigger.posture == "Proactive"
    assert silent.trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.Completed" in silent.trigger.expect
    assert silent.trigger.within == timedelta(seconds=90)  # 3 heartbeats missed
    assert silent.trigger.for_each == {"prefect.resource.id"}
    (crash,) = silent.actions
    assert crash.state == StateType.CRASHED and "no heartbeat for 90 s" in crash.message


def test_the_rerun_action_renders_the_crashed_flow_runs_id():
    """Rendered as the server renders an action's parameters: a template that gives a UUID
    fails there (InvalidJinja), the event's resource id renders."""
    from prefect.server.events.actions import RunDeployment as ServerRunDeployment
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    (action,) = heal_automations(uuid4(), heartbeat_s=30)[0].actions
    params = dict(action.parameters)
    ServerRunDeployment._upgrade_v1_templates(params)
    event = SimpleNamespace(resource=SimpleNamespace(id="prefect.flow-run.1dd2de57"))
    context = HydrationContext(
        raise_on_error=True, render_jinja=True, jinja_context={"event": event}
    )
    assert hydrate(params, context) == {"flow_run_id": "prefect.flow-run.1dd2de57"}


class FakeClient:
    """The Prefect client calls the heal makes, answered from a dict (the real chain runs on a
    server in test_deployment.py)."""

    def __init__(self, run, flow_name="rl-run", answered=()):
        self.run, self.flow_name, self.answered = run, flow_name, list(answered)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_flow_run(self, flow_run_id):
        assert flow_run_id == self.run.id
        return self.run

    def read_flow(self, flow_id):
        return SimpleNamespace(name=self.flow_name)

    def read_deployment(self, deployment_id):
        assert deployment_id == self.run.deployment_id
        from rollflow.flows.run_form import form_parameters

        return SimpleNamespace(parameters=form_parameters(Path("configs/quickstart.toml")))

    def read_flow_runs(self, flow_run_filter):
        return self.answered


def crashed_run(tags=(), overrides=(), **sections):
    """A crashed run of the quickstart's deployment: given its file as ``config``, or
    ``sections`` of the typed form (laid over the deployment's own)."""
    from prefect.states import Crashed

    return SimpleNamespace(
        id=uuid4(),
        name="quickstart",
        state=Crashed(message="exited with -9"),
        state_type="CRASHED",
        deployment_id=uuid4(),
        flow_id=uuid4(),
        parameters={"overrides": list(overrides), **sections}
        if sections
        else {"config": "configs/quickstart.toml", "overrides": list(overrides)},
        tags=list(tags),
    )


@pytest.mark.parametrize(
    ("run", "client_kwargs", "said"),
    [
        (crashed_run(["rollflow-rerun:2"]), {}, "not rerun: 2 of run.max_reruns = 2 used"),
        (crashed_run(overrides=["run.max_reruns=0"]), {}, "0 of run.max_reruns = 0 used"),
        (crashed_run(run={"max_reruns": 0}), {}, "0 of run.max_reruns = 0 used"),  # the form's
        (crashed_run(), {"flow_name": "rl-step"}, "not 'rl-run': left as it is"),
        (crashed_run(), {"answered": ["a rerun"]}, "was already rerun"),
    ],
)
def test_a_crash_that_is_not_the_heals_to_answer_starts_nothing(
    monkeypatch, run, client_kwargs, said
):
    import prefect.client.orchestration
    import prefect.deployments

    from rollflow.flows.heal import heal_crashed_run

    started = []
    monkeypatch.setattr(
        prefect.client.orchestration, "get_client", lambda **kw: FakeClient(run, **client_kwargs)
    )
    monkeypatch.setattr(prefect.deployments, "run_deployment", lambda *a, **kw: started.append(kw))
    assert said in heal_crashed_run.fn(f"prefect.flow-run.{run.id}")
    assert started == []


def test_a_crashed_run_is_rerun_with_its_parameters_and_the_next_count(monkeypatch):
    import prefect.client.orchestration
    import prefect.deployments

    from rollflow.flows.heal import heal_crashed_run

    run = crashed_run(["rollflow", "rollflow-rerun:1", "rollflow-rerun-of:x"])
    started = []

    def run_deployment(deployment_id, **kw):
        started.append((deployment_id, kw))
        return SimpleNamespace(name="quickstart", id=uuid4())

    monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda **kw: FakeClient(run))
    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    said = heal_crashed_run.fn(str(run.id))
    assert "rerun 2 of 2" in said
    ((deployment_id, kw),) = started
    assert deployment_id == run.deployment_id and kw["parameters"] == run.parameters
    assert kw["tags"] == ["rollflow", "rollflow-rerun:2", f"rollflow-rerun-of:{run.id}"]
    assert kw["idempotency_key"] == f"rollflow-rerun-of:{run.id}" and kw["timeout"] == 0


def test_a_heal_automation_already_deleted_is_replaced_all_the_same():
    """``rollflow deploy`` replaces the heal automations of the same name. A delete answered 404
    (gone between the read and the delete: the client's retry of a delete the busy server had
    done) failed the redeploy (a CI run's deployed-run fixture); any other error still fails."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    from rollflow.flows.deploy import ensure_heal_automations

    def answer(status):
        request = httpx.Request("DELETE", "http://api/automations/1")
        response = httpx.Response(status, request=request)
        try:
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise PrefectHTTPStatusError.from_httpx_error(exc) from None

    class Automations:
        def __init__(self, status):
            self.status, self.created = status, []

        def read_automations_by_name(self, name):
            return [SimpleNamespace(id=uuid4())]

        def delete_automation(self, automation_id):
            answer(self.status)

        def create_automation(self, automation):
            self.created.append(automation.name)

    gone = Automations(404)
    lines = ensure_heal_automations(gone, uuid4())
    assert gone.created and len(lines) == len(gone.created)
    with pytest.raises(PrefectHTTPStatusError):
        ensure_heal_automations(Automations(500), uuid4())
