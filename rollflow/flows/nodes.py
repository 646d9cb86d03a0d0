"""Trainer nodes as Prefect flow runs: with ``trainer.node_deployment`` set, every node of the
trainer, node 0 included (``PlacedTrainer``, below), is a flow run of
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

Node 0 serves the trainer's API: its body starts its own launcher, bound to the address its
host reaches the run's host from, and writes where it serves and where the other nodes meet it
(``trainer.master_addr``, ``auto``: that address) to the run's storage (``NODE_0_FILE``); the
run, which keeps no trainer process then, waits for that record (``PlacedTrainer.wait_placed``)
before it submits nodes 1.. with that address.

A node whose flow run ends while the run goes on is a lost trainer (``TrainerNodes.check_running``,
asked by the run's health check): the run restarts the trainer on every node, the nodes' flow
runs cancelled and waited for (``stop``), then submitted again. A node whose run's flow run
ended (its host lost: marked Crashed) stops with it (``DriverWatch``).

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
from uuid import UUID

from prefect import flow

from rollflow.flows.deploy import NODE_FLOW_NAME
from rollflow.flows.terminal import PrefectRunLog, say
from rollflow.infra.errors import ServiceError
from rollflow.infra.secrets import hand_over_secret_block
from rollflow.infra.service import ManagedProcess

FOLLOW_INTERVAL_S = 0.5
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
NODE_0_FILE = "control/trainer/node-0.json"  # where node 0's flow run serves, in run storage
# Beyond a placed process's own start-up deadline: a worker's poll, the flow run's start (a
# placed server's: the policy's copy too).
PLACEMENT_S = 120.0
DRIVER_CHECK_S = 10.0  # how often a node reads its run's flow run's state


@flow(
    name=NODE_FLOW_NAME,
    flow_run_name="{run}: trainer node {node}",
    persist_result=False,
    validate_parameters=False,
)
def trainer_node(
    run: str,
    node: int,
    argv: list[str],
    env: dict[str, str] | None = None,
    serve: dict[str, Any] | None = None,
    driver: str | None = None,
    storage_secret: list[str] | None = None,
) -> dict:
    """Run trainer node ``node`` of run ``run``: the launcher ``argv`` (with ``env``) to its end;
    node 0 (``serve``: ``PlacedTrainer``'s settings) starts its own launcher, serving the
    trainer's API. ``driver``: the run's flow run, whose end ends the node (``DriverWatch``).
    ``storage_secret``: the run's storage root and ``run.storage_secret``, the Secret block this
    flow run loads the storage's credentials from (its ranks inherit them)."""
    from prefect.context import get_run_context

    flow_run_id = get_run_context().flow_run.id
    if storage_secret:
        hand_over_secret_block(*storage_secret)
    watch = DriverWatch(driver)
    with PrefectRunLog(flow_run_id):
        if serve is not None:
            return _serve_node_0(run, serve, env or {}, flow_run_id, watch)
        return _run_node(run, node, argv, env, watch)


class DriverWatch:
    """Whether the run's flow run (the node's driver) is over, read every ``interval_s``: a node
    on a host of its own outlives a run whose host was lost, its ranks idle for good and holding
    their devices, unless it ends with it. The Prefect API not answering is no end."""

    def __init__(self, driver: str | None, interval_s: float = DRIVER_CHECK_S):
        self.driver, self.interval_s = driver, interval_s
        self.ended: str | None = None  # the driver's terminal state, once seen
        self._read_at = time.monotonic()

    def over(self) -> bool:
        if self.driver is None or self.ended is not None:
            return self.ended is not None
        if time.monotonic() - self._read_at >= self.interval_s:
            self._read_at = time.monotonic()
            try:
                state = flow_run_state(UUID(self.driver))
            except Exception:  # noqa: BLE001 - the API's hiccup: read again later
                return False
            if state in TERMINAL:
                self.ended = state
        return self.ended is not None


def _serve_node_0(
    run: str, serve: dict[str, Any], env: dict[str, str], flow_run_id, watch: DriverWatch
) -> dict:
    """Node 0's body: its launcher, bound to the address its host reaches the run's host from
    (``serve["reach"]``), ``trainer.master_addr = "auto"`` made that address; where it serves
    and meets the other nodes written to the run's storage (``NODE_0_FILE``) before it starts;
    its log said line by line, to its end."""
    from rollflow.flows.servers import read_key
    from rollflow.infra.network import route_source
    from rollflow.infra.service import free_port
    from rollflow.infra.storage import RunStorage
    from rollflow.tasks.train.launch import TrainerProcess
    from rollflow.trainer.protocol import ServiceArgs

    storage = RunStorage(serve["storage"], run, serve.get("storage_options") or {})
    address = route_source(serve["reach"])
    args = ServiceArgs.model_validate_json(serve["args"])
    tr = args.trainer
    if tr.master_addr == "auto":
        tr = tr.model_copy(update={"master_addr": address})
    args = args.model_copy(update={"trainer": tr, "host": address, "port": free_port(address)})
    log_dir = Path(tempfile.mkdtemp(prefix=f"rollflow-{run}-node-0-"))
    trainer = TrainerProcess(
        args,
        token=read_key(storage),
        log_dir=log_dir,
        device_env=env,
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


def follow_to_its_end(proc: ManagedProcess, what: str, watch: DriverWatch | None = None) -> int:
    """Say each line of the started ``proc``'s log until it exits (or ``watch`` sees the run's
    flow run over), stop what is left of it; return its exit code 0, else raise
    ``ServiceError`` naming ``what``, the code and the log's last lines (its flow run ends
    Failed)."""
    over = watch.over if watch is not None else lambda: False
    try:
        follow_log(proc.log_path, lambda: proc.is_alive() and not over(), say)
    finally:
        proc.stop()
    if watch is not None and watch.ended is not None:
        raise ServiceError(
            f"{what}: stopped, its run's flow run ({watch.driver}) ended {watch.ended} (its host "
            "lost, or the run stopped without ending its nodes); a rerun submits the node again"
        )
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
    """The flow runs of a run's trainer nodes (submitted by ``submit``), and their end."""

    def __init__(
        self,
        deployment: str,
        queues: list[str],
        progress=print,
        gpus: int = 0,
        storage_secret: tuple[str, str] | None = None,
    ):
        """``gpus``: each node's GPUs (its ranks'), asked of a pool that places GPUs by job
        variable (``gpu_request``); ``storage_secret``: the run's storage root and
        ``run.storage_secret`` (a Secret block's name), which every node's flow run loads."""
        self.deployment, self.queues, self.progress = deployment, list(queues), progress
        self.gpus, self.storage_secret = gpus, storage_secret
        self.job_variables: set[str] = set()  # what its pool's template takes (``check``)
        self.flow_runs: dict[int, UUID] = {}

    def submit(
        self,
        run: str,
        commands: dict[int, tuple[list[str], dict[str, str]]],
        serve: dict[str, Any] | None = None,
    ) -> None:
        """Submit node k's flow run for each ``k -> (argv, env)`` of ``commands``, as children
        of the calling flow run, each to its queue (``trainer.node_queues``) where named; node
        0's with ``serve`` (``PlacedTrainer``'s settings: it starts its own launcher)."""
        from prefect.deployments import run_deployment
        from prefect.runtime import flow_run as this_run

        driver = this_run.get_id()  # the run's flow run (None outside one): the nodes end with it
        for node, (argv, env) in sorted(commands.items()):
            queue = self.queues[node] if self.queues else None
            parameters = {"run": run, "node": node, "argv": argv, "env": env, "driver": driver}
            if self.storage_secret:
                parameters["storage_secret"] = list(self.storage_secret)  # names, no value
            if node == 0:
                parameters["serve"] = serve
            flow_run = run_deployment(
                self.deployment,
                parameters=parameters,
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


class PlacedTrainer:
    """Trainer node 0 as a flow run of ``trainer.node_deployment`` (one of ``nodes``'): what the
    run asks of a ``TrainerProcess`` (start, wait_healthy, check_alive, is_alive, stop, client),
    over the Prefect API and the run's storage. Where it serves, and the address the other nodes
    and the weight group meet it at, are known once its flow run says so (``wait_placed``)."""

    def __init__(
        self,
        nodes: TrainerNodes,
        run: str,
        args,
        token: str,
        storage,
        settings: dict[str, Any],
        progress=print,
    ):
        """``args``: the trainer's ``ServiceArgs`` (host and port are node 0's to choose);
        ``storage``: the run's ``RunStorage``; ``settings``: ``storage`` (root and options as
        the config gives them, without credentials: node 0's host has its own), ``reach`` (the
        run's host, which node 0 serves toward), ``env`` (its devices), ``cpus``."""
        self.nodes, self.run, self.args, self.token = nodes, run, args, token
        self.storage, self.settings, self.progress = storage, dict(settings), progress
        self.startup_timeout_s = args.trainer.startup_timeout_s + PLACEMENT_S
        self.args_file = Path("trainer-args.json")  # (a name only: nothing is written here)
        self.client = None
        self.endpoint = None
        self.master_addr: str | None = None
        self.ranks: list[dict[str, Any]] = []
        self._state = "PENDING"

    @property
    def flow_run_id(self) -> UUID | None:
        return self.nodes.flow_runs.get(0)

    @property
    def log_path(self) -> str:
        """Where its log is: its flow run's (shown by ``see ...`` in messages)."""
        return f"the log of trainer node 0's flow run ({self.flow_run_id}) in the Prefect UI"

    def state(self) -> str:
        """Its flow run's state type; the last one read while the Prefect API does not answer
        (its hiccup is no node's death)."""
        if self.flow_run_id is None:
            return "CANCELLED"
        try:
            self._state = flow_run_state(self.flow_run_id)
        except Exception:  # noqa: BLE001 - read again at the next ask
            pass
        return self._state

    def is_alive(self) -> bool:
        """Whether its flow run is not over (not whether the trainer answers)."""
        return self.flow_run_id is not None and self.state() not in TERMINAL

    def start(self) -> PlacedTrainer:
        """Submit node 0's flow run and return (the trainer loads while the rest starts)."""
        root, options = self.settings["storage"]
        serve = {
            "storage": root,
            "storage_options": options,
            "args": self.args.model_dump_json(),
            "reach": self.settings["reach"],
            "cpus": list(self.settings.get("cpus") or ()),
        }
        self.client = self.endpoint = self.master_addr = None
        self._state = "PENDING"
        self.nodes.submit(self.run, {0: ([], dict(self.settings.get("env") or {}))}, serve)
        return self

    def wait_placed(self) -> str:
        """Wait until node 0's flow run says where it serves; return the address the other
        nodes and the weight group meet it at. Raise ``ServiceError`` naming what did not
        happen (no worker took it, it ended first) within the deadline."""
        from rollflow.infra.http import Endpoint
        from rollflow.tasks.train.client import TrainerClient

        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            state = self.state()
            if state in TERMINAL:
                raise ServiceError(
                    f"trainer node 0's flow run ended {state} before it served; see {self.log_path}"
                )
            try:
                where = self.storage.read_json(NODE_0_FILE)
            except ValueError:
                where = None  # being written
            if isinstance(where, dict) and where.get("flow_run_id") == str(self.flow_run_id):
                self.endpoint = Endpoint("trainer", where["url"].rstrip("/"), self.token)
                self.client = TrainerClient(self.endpoint, self.args.trainer.request_timeout_s)
                self.master_addr = where["master_addr"]
                self.progress(
                    f"trainer: node 0 serves at {self.endpoint.url}, meets the other nodes at "
                    f"{self.master_addr}"
                )
                return self.master_addr
            if time.monotonic() > deadline:
                queue = self.nodes.queues[0] if self.nodes.queues else ""
                where_ = f"work queue {queue!r}" if queue else "its work queue"
                raise ServiceError(
                    f"trainer node 0's flow run ({self.flow_run_id}) was {state} "
                    f"{self.startup_timeout_s:.0f}s after it was submitted and did not say where "
                    f"it serves: start a worker of {self.nodes.deployment}'s pool ({where_}) on "
                    "node 0's host (`prefect worker start --pool ... --work-queue ...`)"
                    if state in ("SCHEDULED", "PENDING")
                    else f"trainer node 0's flow run ({state}) did not say where it serves "
                    f"within {self.startup_timeout_s:.0f}s; see {self.log_path}"
                )
            time.sleep(1.0)

    def wait_healthy(self) -> None:
        """Block until node 0's rank 0 answers, all ranks up; raise ``ServiceError`` if its flow
        run ends first or the deadline passes."""
        if self.client is None:
            self.wait_placed()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                health = self.client.health(timeout_s=2)
                self.ranks = health["ranks"]
                if health["ok"]:
                    return
            except ServiceError:
                pass  # not answering yet
            state = self.state()
            if state in TERMINAL:
                raise ServiceError(f"trainer node 0's flow run ended {state}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the trainer at {self.endpoint.url} did not become healthy within "
                    f"{self.startup_timeout_s:.0f}s; see {self.log_path}"
                )
            time.sleep(0.5)

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raise ``ServiceError`` if node 0's flow run ended or the trainer does not answer
        (``timeout_s``: the probe's); naming the dead rank where rank 0 says."""
        state = self.state()
        if state in TERMINAL:
            raise ServiceError(
                f"trainer node 0's flow run ({self.flow_run_id}) ended {state}; see {self.log_path}"
            )
        from rollflow.tasks.train.launch import probe_health

        probe_health(self.client, timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to shut down cleanly and wait for node 0's flow run to end with them;
        cancel it where it did not (its worker stops the process)."""
        if self.flow_run_id is None:
            return
        deadline = time.monotonic() + timeout_s
        clean = min(deadline, time.monotonic() + 15.0)  # its ranks' own teardown
        try:
            if self.client is not None and self.state() not in TERMINAL:
                self.client.shutdown(timeout_s=min(10.0, timeout_s))
            while self.state() not in TERMINAL and time.monotonic() < clean:
                time.sleep(0.5)
            if self.state() in TERMINAL:
                return
        except Exception:  # noqa: BLE001 - a hung rank, or the API's hiccup: cancelled below
            pass
        cancel_and_wait(
            self.flow_run_id,
            max(1.0, deadline - time.monotonic()),
            "trainer: node 0",
            self.progress,
        )

    def set_aside_log(self) -> None:
        """A lost trainer's log stays in its flow run's (nothing on this host to keep)."""


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


def cancel_and_wait(flow_run_id: UUID, timeout_s: float, what: str, progress=print) -> None:
    """Cancel the flow run (of ``what``, for messages) and wait up to ``timeout_s`` for its end
    (its worker stops the process, the guard takes the children); said when it could not be
    cancelled or has not ended by then. The Prefect API's hiccup is read through."""
    try:
        cancel_flow_run(flow_run_id)
    except Exception as exc:  # noqa: BLE001 - the API gone: said, nothing more to do here
        progress(f"{what}: could not cancel its flow run ({flow_run_id}): {exc}")
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if flow_run_state(flow_run_id) in TERMINAL:
                return
        except Exception:  # noqa: BLE001 - read again until the deadline
            pass
        time.sleep(0.5)
    progress(
        f"{what}: its flow run ({flow_run_id}) was cancelled but has not ended after "
        f"{timeout_s:.0f}s; its worker stops it"
    )


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
