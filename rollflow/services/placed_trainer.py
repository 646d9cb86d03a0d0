"""The run's side of trainer nodes placed by Prefect: ``TrainerNodes`` and ``PlacedTrainer``.

With ``trainer.node_deployment`` set, every node of the trainer, node 0 included, is a flow run
of a ``rollflow-trainer-node`` deployment (its body: ``flows/trainer_node.py``) that the run
submits (``TrainerNodes.submit``) to that deployment's work pool, a work queue per node where
the config names them (``trainer.node_queues``): nobody starts a command on the other hosts.

``PlacedTrainer`` is node 0 as the run sees it: what it asks of a ``TrainerProcess`` over the
Prefect API and the run's storage. It waits for node 0's record of where it serves
(``placed.NODE_0_FILE``, ``wait_placed``) before nodes 1.. are submitted with that address.

A node whose flow run ends while the run goes on is a lost trainer (``TrainerNodes.check_running``,
asked by the run's health check): the run restarts the trainer on every node, the nodes' flow
runs cancelled and waited for (``stop``), then submitted again. This module imports no torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from uuid import UUID

from rollflow.infra.errors import ServiceError
from rollflow.services import placed
from rollflow.services.placed import (
    NODE_0_FILE,
    PLACEMENT_S,
    TERMINAL,
    check_deployment,
    gpu_request,
)
from rollflow.trainer.protocol import RankInfo


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
        args: str,
        gpus: dict[int, list[int]],
        serve: dict[str, Any] | None = None,
    ) -> None:
        """Submit node k's flow run for each ``k -> gpus`` (positions in its host's
        ``CUDA_VISIBLE_DEVICES``, [] on CPU: its flow run resolves them there), with the
        trainer's arguments ``args`` (``ServiceArgs`` as JSON), from which it makes its launcher
        command on its host; as children of the calling flow run, each to its queue
        (``trainer.node_queues``) where named; node 0's with ``serve`` (``PlacedTrainer``'s
        settings: it serves the trainer's API)."""
        from prefect.deployments import run_deployment
        from prefect.runtime import flow_run as this_run

        driver = this_run.get_id()  # the run's flow run (None outside one): the nodes end with it
        for node, node_gpus in sorted(gpus.items()):
            queue = self.queues[node] if self.queues else None
            parameters = {
                "run": run,
                "node": node,
                "args": args,
                "gpus": list(node_gpus),
                "driver": driver,
            }
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
        return {
            node: placed.flow_run_state(flow_run_id) for node, flow_run_id in self.flow_runs.items()
        }

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
                placed.cancel_flow_run(self.flow_runs[node])
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
        run's host, which node 0 serves toward), ``gpus`` (positions in its host's
        ``CUDA_VISIBLE_DEVICES``, which its flow run resolves there), ``cpus``."""
        self.nodes, self.run, self.args, self.token = nodes, run, args, token
        self.storage, self.settings, self.progress = storage, dict(settings), progress
        self.startup_timeout_s = args.trainer.startup_timeout_s + PLACEMENT_S
        self.args_file = Path("trainer-args.json")  # (a name only: nothing is written here)
        self.client = None
        self.endpoint = None
        self.master_addr: str | None = None
        self.ranks: list[RankInfo] = []
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
            self._state = placed.flow_run_state(self.flow_run_id)
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
            "reach": self.settings["reach"],
            "cpus": list(self.settings.get("cpus") or ()),
        }
        self.client = self.endpoint = self.master_addr = None
        self._state = "PENDING"
        gpus = {0: list(self.settings.get("gpus") or ())}
        self.nodes.submit(self.run, self.args.model_dump_json(), gpus, serve)
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
                self.ranks = health.ranks
                if health.ok:
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
        from rollflow.services.trainer_process import probe_health

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
        placed.cancel_and_wait(
            self.flow_run_id,
            max(1.0, deadline - time.monotonic()),
            "trainer: node 0",
            self.progress,
        )

    def set_aside_log(self) -> None:
        """A lost trainer's log stays in its flow run's (nothing on this host to keep)."""
