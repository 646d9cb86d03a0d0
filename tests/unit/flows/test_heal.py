"""The heal automations' definitions and the rerun count (the chain itself runs on a real
Prefect server in tests/integration/flows/test_deployment.py)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from uuid import uuid4

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
