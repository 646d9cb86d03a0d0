"""Machine loss: a run flow run that crashed is started again by Prefect, with nobody acting.

``rollflow deploy`` registers the ``rollflow-heal/crashed-run`` deployment and two automations
(``heal_automations``):

- **rerun a crashed run**: on ``prefect.flow-run.Crashed`` of an ``rl-run`` flow run (its worker
  saw the process die: killed, OOM), run ``rollflow-heal/crashed-run`` for it;
- **crash a silent run**: an ``rl-run`` flow run that sent a heartbeat and then nothing (no
  heartbeat, no end) for ``3 ×`` the heartbeat interval lost its host, worker included, so no
  worker will report it: mark it Crashed, which the first automation then reruns.

``heal_crashed_run`` starts the crashed flow run's deployment again with the same parameters, on
its pool (any worker of it: another host when the first is gone). The new flow run resumes from
the run's storage after its last committed step, as any rerun does, so every step is committed
once. It reruns a run at most ``run.max_reruns`` times (counted along the chain of reruns by
the tag ``rollflow-rerun:<n>``) and never twice for one crash (tag ``rollflow-rerun-of:<id>``,
also the rerun's idempotency key: the server fired the automation twice for one crash once).
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect import flow

from rollflow.flows.names import FLOW_NAME, HEAL_FLOW_NAME

RERUN_TAG = "rollflow-rerun"  # rollflow-rerun:<n>: the n-th rerun of its run
RERUN_OF_TAG = "rollflow-rerun-of"  # rollflow-rerun-of:<flow run id>: the crash it answers
RERUN_AUTOMATION = "rollflow: rerun a crashed run"
SILENT_AUTOMATION = "rollflow: crash a silent run"
SILENT_HEARTBEATS = 3  # heartbeats missed before a run flow run counts as lost with its host


def reruns_of(tags: list[str]) -> int:
    """How many reruns led to the flow run with ``tags`` (0: the first)."""
    counts = [t.split(":", 1)[1] for t in tags if t.startswith(f"{RERUN_TAG}:")]
    return max((int(c) for c in counts if c.isdigit()), default=0)


@flow(
    name=HEAL_FLOW_NAME, flow_run_name="heal {flow_run_id}", persist_result=False, log_prints=True
)
def heal_crashed_run(flow_run_id: str) -> str:
    """Start the crashed run flow run ``flow_run_id`` (its id, or its event resource id
    ``prefect.flow-run.<id>``) again, with the same deployment and parameters, unless it is not
    a crashed run flow run, was already rerun, or used ``run.max_reruns``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.deployments import run_deployment

    from rollflow.flows.run_form import config_from_parameters

    flow_run_id = flow_run_id.removeprefix("prefect.flow-run.")
    answered = f"{RERUN_OF_TAG}:{flow_run_id}"
    with get_client(sync_client=True) as client:
        crashed = client.read_flow_run(UUID(flow_run_id))
        what = f"flow run {crashed.name!r} ({flow_run_id})"
        if crashed.state is None or not crashed.state.is_crashed():
            return _say(f"{what} is {crashed.state_type}, not crashed: nothing to do")
        if crashed.deployment_id is None:
            return _say(f"{what} has no deployment to run again: rerun it by hand")
        flow_name = client.read_flow(crashed.flow_id).name
        if flow_name != FLOW_NAME:
            return _say(f"{what} is of flow {flow_name!r}, not {FLOW_NAME!r}: left as it is")
        if client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[answered]))
        ):
            return _say(f"{what} was already rerun")
        params = crashed.parameters
        deployed = client.read_deployment(crashed.deployment_id).parameters
        limit = config_from_parameters(params, deployed).run.max_reruns
        done = reruns_of(crashed.tags)
        if done >= limit:
            return _say(f"{what} crashed and is not rerun: {done} of run.max_reruns = {limit} used")
    rerun = run_deployment(
        crashed.deployment_id,
        parameters=params,
        timeout=0,  # started, not waited for: it is a run of its own
        # The server may fire the automation twice for one crash, and two heals may then pass
        # the check above together: the key makes the server create one flow run for both.
        idempotency_key=answered,
        tags=[
            *(t for t in crashed.tags if not t.startswith("rollflow-rerun")),
            f"{RERUN_TAG}:{done + 1}",
            answered,
        ],
        as_subflow=False,
    )
    return _say(
        f"{what} crashed ({crashed.state.message or 'no message'}); rerun {done + 1} of "
        f"{limit}: flow run {rerun.name!r} ({rerun.id}) resumes it from its storage"
    )


def _say(message: str) -> str:
    print(message)
    return message


def heal_automations(heal_deployment_id: UUID, heartbeat_s: int) -> list:
    """The two automations of the module docstring, for the heal deployment's id and the
    workers' flow-run heartbeat interval (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    run_flow = {"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME}
    silent_s = SILENT_HEARTBEATS * heartbeat_s
    ends = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    return [
        AutomationCore(
            name=RERUN_AUTOMATION,
            description="An rl-run flow run crashed (its process or host lost): start it again, "
            "resuming from its storage (rollflow/flows/heal.py).",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Crashed"},
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=run_flow,
                posture=Posture.Reactive,
                threshold=1,
            ),
            actions=[
                RunDeployment(
                    source="selected",
                    deployment_id=heal_deployment_id,
                    # The event's resource id, "prefect.flow-run.<id>" (a UUID does not render
                    # through the action's JSON templating: InvalidJinja).
                    parameters={"flow_run_id": "{{ event.resource.id }}"},
                )
            ],
        ),
        AutomationCore(
            name=SILENT_AUTOMATION,
            description=f"An rl-run flow run sent no heartbeat for {silent_s} s and did not end: "
            "its host is gone with its worker; mark it Crashed so that it is rerun.",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", *ends},
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=run_flow,
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=silent_s),
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"no heartbeat for {silent_s} s: its host was lost",
                )
            ],
        ),
    ]
