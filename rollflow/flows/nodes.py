"""Trainer nodes as Prefect flow runs: node k > 0 of a trainer on several hosts is a flow run of
a ``rollflow-trainer-node`` deployment that the run flow submits (``TrainerNodes.submit``) to
that deployment's work pool, where a worker on the node's host runs it: nobody starts a command
on the other hosts.

The flow run is the node. Its body starts the node's launcher under the ``ManagedProcess``
guard, on its main thread, so a cancelled or crashed flow run takes the node's ranks with it;
it says the node's log lines in the flow run's log (the UI's Logs tab; ``PrefectRunLog``), and it ends with
the node: Completed when the launcher exits 0 (the run's trainer ended), Failed naming the exit
code and the log's last lines otherwise. Everything the node needs travels in its parameters
(the launcher command, with the trainer's arguments in it: what the run prints when it places
nodes by hand) and the run's object storage (the policy, checkpoints): no shared file system.

A node whose flow run ends while the run goes on is a lost trainer (``TrainerNodes.check_running``,
asked by the run's health check): the run restarts the trainer on every node, the nodes' flow
runs cancelled and waited for (``stop``), then submitted again.

Which host takes which node: a deployment's pool, and a work queue per node where the config
names them (``trainer.node_queues``): a process pool on bare hosts has a queue per host, each
host's worker started with ``--work-queue``; a Kubernetes or Docker pool places the job itself.
This module imports no torch: a worker starts the flow in seconds.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from uuid import UUID

from prefect import flow

from rollflow.flows.deploy import NODE_FLOW_NAME
from rollflow.flows.terminal import PrefectRunLog, say
from rollflow.infra.errors import ServiceError
from rollflow.infra.service import ManagedProcess

FOLLOW_INTERVAL_S = 0.5
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@flow(
    name=NODE_FLOW_NAME,
    flow_run_name="{run}: trainer node {node}",
    persist_result=False,
    validate_parameters=False,
)
def trainer_node(run: str, node: int, argv: list[str], env: dict[str, str] | None = None) -> dict:
    """Run trainer node ``node`` of run ``run``: the launcher ``argv`` (with ``env``) to its end."""
    from prefect.context import get_run_context

    with PrefectRunLog(get_run_context().flow_run.id):
        return _run_node(run, node, argv, env)


def _run_node(run: str, node: int, argv: list[str], env: dict[str, str] | None = None) -> dict:
    """The node's launcher under the guard, each of its log lines said (``say``: the flow run's
    log and the worker's output), to its end."""
    log_path = Path(tempfile.mkdtemp(prefix=f"rollflow-{run}-node-{node}-")) / "trainer-node.log"
    proc = ManagedProcess(f"trainer-node-{node}", argv, log_path, env=env)
    say(f"trainer node {node} of run {run}: starting; its log on this host: {log_path}")
    proc.start()
    code = follow_to_its_end(proc, f"trainer node {node} of run {run}")
    say(f"trainer node {node} of run {run}: ended with the run's trainer")
    return {"run": run, "node": node, "exit_code": code}


def follow_to_its_end(proc: ManagedProcess, what: str) -> int:
    """Say each line of the started ``proc``'s log until it exits, stop what is left of it;
    return its exit code 0, else raise ``ServiceError`` naming ``what``, the code and the log's
    last lines (its flow run ends Failed)."""
    try:
        follow_log(proc.log_path, proc.is_alive, say)
    finally:
        proc.stop()
    code = proc.returncode
    if code != 0:
        raise proc.error(f"{what} exited with code {code}")
    return code


def follow_log(path: Path, alive, out, interval_s: float = FOLLOW_INTERVAL_S) -> None:
    """Send each whole line written to ``path`` to ``out`` until ``alive()`` is false, then
    the rest (a last line without its newline too)."""
    offset, pending = 0, b""
    while True:
        running = alive()  # read after: a line written just before the exit is not missed
        try:
            with open(path, "rb") as log:
                log.seek(offset)
                chunk = log.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            out(line.decode(errors="replace"))
        if not running:
            if pending:
                out(pending.decode(errors="replace"))
            return
        time.sleep(interval_s)


class TrainerNodes:
    """The flow runs of a run's trainer nodes 1.. (submitted by ``submit``), and their end."""

    def __init__(self, deployment: str, queues: list[str], progress=print, gpus: int = 0):
        """``gpus``: each node's GPUs (its ranks'), asked of a pool that places GPUs by job
        variable (``gpu_request``)."""
        self.deployment, self.queues, self.progress = deployment, list(queues), progress
        self.gpus = gpus
        self.job_variables: set[str] = set()  # what its pool's template takes (``check``)
        self.flow_runs: dict[int, UUID] = {}

    def submit(self, run: str, commands: dict[int, tuple[list[str], dict[str, str]]]) -> None:
        """Submit node k's flow run for each ``k -> (argv, env)`` of ``commands``, as children
        of the calling flow run, each to its queue (``trainer.node_queues``) where named."""
        from prefect.deployments import run_deployment

        for i, (node, (argv, env)) in enumerate(sorted(commands.items())):
            queue = self.queues[i] if self.queues else None
            flow_run = run_deployment(
                self.deployment,
                parameters={"run": run, "node": node, "argv": argv, "env": env},
                timeout=0,  # submitted: the node joins the trainer's rendezvous when it starts
                work_queue_name=queue,
                job_variables=gpu_request(self.job_variables, self.gpus),
                tags=["rollflow", f"rollflow-run:{run}", f"rollflow-trainer-node:{node}"],
            )
            self.flow_runs[node] = flow_run.id
            self.progress(
                f"trainer: node {node} submitted as flow run {flow_run.name!r} ({flow_run.id}) of "
                f"{self.deployment}{f', work queue {queue}' if queue else ''}"
            )

    def check(self) -> None:
        """Raise ``ServiceError``, saying what to do, unless the Prefect API holds the deployment."""
        self.job_variables = check_deployment(
            self.deployment,
            "trainer.node_deployment",
            "or leave trainer.node_deployment empty to start the nodes by hand",
        )

    def states(self) -> dict[int, str]:
        """Each node's flow run state now (its type, e.g. RUNNING)."""
        return {node: flow_run_state(flow_run_id) for node, flow_run_id in self.flow_runs.items()}

    def end(self, grace_s: float = 30.0) -> dict[int, str]:
        """After node 0 stopped: each node's flow run ends with it (its ranks lose the rendezvous);
        one not ended within ``grace_s`` is cancelled (its worker stops the process). Returns
        the states at the end."""
        if not self.flow_runs:
            return {}
        deadline = time.monotonic() + grace_s
        states = self._states_or_none()
        while states is not None and time.monotonic() < deadline:
            if all(s in TERMINAL for s in states.values()):
                break
            time.sleep(1.0)
            states = self._states_or_none()
        else:
            self._cancel([n for n, s in (states or {}).items() if s not in TERMINAL] or None)
        for node, state in (states or {}).items():
            if state in TERMINAL and state != "COMPLETED":
                self.progress(
                    f"trainer: node {node}'s flow run ({self.flow_runs[node]}) ended {state}; "
                    "its log is the flow run's, in the Prefect UI"
                )
        return states or {}

    def check_running(self) -> None:
        """Raise ``ServiceError`` naming a node whose flow run ended while the run goes on (its
        ranks died, or its worker's host was lost and the flow run was marked Crashed). The
        Prefect API not answering is no node's death: nothing is raised then."""
        states = self._states_or_none()
        for node, state in sorted((states or {}).items()):
            if state in TERMINAL:
                raise ServiceError(
                    f"trainer node {node}'s flow run ({self.flow_runs[node]}) ended {state}; "
                    "its log is the flow run's, in the Prefect UI"
                )

    def stop(self, timeout_s: float) -> dict[int, str]:
        """Node 0 was lost and is restarted: cancel every node's flow run still running and wait
        up to ``timeout_s`` for all to end (their ranks must leave the rendezvous before the new
        ones join it); raise ``ServiceError`` naming those that did not."""
        states = self.states()
        self._cancel([n for n, s in states.items() if s not in TERMINAL])
        deadline = time.monotonic() + timeout_s
        while any(s not in TERMINAL for s in states.values()):
            if time.monotonic() > deadline:
                running = {n: s for n, s in states.items() if s not in TERMINAL}
                raise ServiceError(
                    f"trainer: node(s) {sorted(running)} still {sorted(set(running.values()))} "
                    f"{timeout_s:.0f}s after their flow runs were cancelled; their workers "
                    "did not stop them"
                )
            time.sleep(1.0)
            states = self.states()
        return states

    def _states_or_none(self) -> dict[int, str] | None:
        try:
            return self.states()
        except Exception as exc:  # noqa: BLE001 - the API gone: nothing more to ask of it
            self.progress(f"trainer: could not read the nodes' flow runs: {exc}")
            return None

    def _cancel(self, nodes: list[int] | None) -> None:
        for node in nodes if nodes is not None else list(self.flow_runs):
            try:
                cancel_flow_run(self.flow_runs[node])
                self.progress(
                    f"trainer: node {node}'s flow run did not end with the run: cancelled"
                )
            except Exception as exc:  # noqa: BLE001 - best effort, said
                self.progress(f"trainer: could not cancel node {node}'s flow run: {exc}")


# ------------------------------------------------- flow runs of a deployment, as processes


def gpu_request(job_variables: set[str], gpus: int) -> dict[str, int] | None:
    """The job variables that ask a pool for ``gpus`` GPUs per flow run: ``{"gpus": N}`` on a
    pool whose template has that variable (prefect.yaml's Kubernetes and Docker pools: a pod's
    ``nvidia.com/gpu`` limit, a container's device request), None elsewhere (a process pool's
    host has its GPUs)."""
    return {"gpus": gpus} if gpus and "gpus" in job_variables else None


def check_deployment(deployment: str, key: str, otherwise: str) -> set[str]:
    """Raise ``ServiceError`` naming config key ``key`` and what to do (``otherwise``: the
    alternative) unless the Prefect API holds ``deployment``; returns the job variables its
    work pool's template takes."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
            template = client.read_work_pool(found.work_pool_name).base_job_template
            return set(((template or {}).get("variables") or {}).get("properties") or {})
        except ObjectNotFound:
            raise ServiceError(
                f"{key} = {deployment!r}: no such deployment on the Prefect API at "
                f"{PREFECT_API_URL.value() or '(a temporary server)'}; run `rollflow deploy` "
                f"against the server whose workers run on the other hosts (PREFECT_API_URL), "
                f"{otherwise}"
            ) from None


def flow_run_state(flow_run_id: UUID) -> str:
    """The flow run's state type now, e.g. ``RUNNING`` (``PENDING`` before it has one)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state.type.value if state is not None else "PENDING"


def cancel_flow_run(flow_run_id: UUID) -> None:
    """Ask for the flow run's end: its worker stops its process (the guard takes its children)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
