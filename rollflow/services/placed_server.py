"""The run's side of a vLLM server placed by Prefect: ``PlacedServer``.

With ``inference.server_deployment`` set, each server of the fleet is a flow run of that
deployment (its body: ``flows/inference_server.py``), submitted to the slot's work queue
(``inference.server_queues``). A ``PlacedServer`` stands where a local ``InferenceServer`` does,
under the same supervisor (``vllm_supervisor.py``): alive while its flow run is not over; found
where its flow run says it serves (``placed.slot_file``); stopped by cancelling the flow run;
restarted by submitting the slot again to the same queue with the same port, so that on a queue
of one host it comes back at the same URL (one that a pool placed elsewhere is followed there:
the supervisor's ``_follow_move``). This module imports no torch.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

from rollflow.infra.errors import InferenceError
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet import keys
from rollflow.services import placed
from rollflow.services.placed import (
    PLACEMENT_S,
    TERMINAL,
    slot_file,
)

STATE_TTL_S = 0.5  # how long a read flow-run state is taken as current


POLL_S = 1.0


class PlacedServer:
    """Server ``slot`` of the fleet as a flow run of ``deployment``: what the supervisor asks of
    an ``InferenceServer`` (spawn, wait_ready, is_alive, stop, url), over the Prefect API and the
    run's storage."""

    def __init__(
        self,
        deployment: str,
        queue: str,
        run: str,
        slot: int,
        storage: tuple[str, dict[str, Any]],
        model: tuple[str, int],
        settings: dict[str, Any],
        api_key: str,
        progress=print,
        job_variables: dict[str, Any] | None = None,
        storage_secret: str | None = None,
    ):
        """``storage``: the run's storage root and options as its config gives them (without
        credentials: the server's host has its own, as the trainer's nodes do, or loads them from
        the Secret block ``storage_secret``, the run's ``run.storage_secret``);
        ``job_variables``: what its flow runs ask of the pool (its GPUs: ``nodes.gpu_request``)."""
        self.job_variables, self.storage_secret = job_variables, storage_secret
        self.deployment, self.queue, self.run, self.slot = deployment, queue, run, slot
        self.storage_root, self.storage_options = storage
        self.storage, self.model = RunStorage(storage[0], run, storage[1]), model
        self.settings = dict(settings)  # its "port" is set once it served: restarts keep it
        self.api_key, self.progress = api_key, progress
        # Beyond vLLM's own start-up deadline: a worker's poll, the flow run's start, the
        # policy's copy.
        self.startup_timeout_s = float(settings["startup_timeout_s"]) + PLACEMENT_S
        self.flow_run_id: UUID | None = None
        self.flow_run_name = ""
        self._cancelled = False  # stop() asked its flow run to end: spawn() submits anew
        self._url: str | None = None
        self._state: tuple[float, str] = (0.0, "PENDING")

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError(f"vLLM server {self.slot} has not told where it serves yet")
        return self._url

    @property
    def log_path(self) -> str:
        """Where its log is: its flow run's (shown by ``see ...`` in messages)."""
        if self.flow_run_id is None:
            return f"the flow runs of {self.deployment} in the Prefect UI"
        return f"the log of flow run {self.flow_run_name!r} ({self.flow_run_id}) in the Prefect UI"

    def ended(self) -> str:
        """How it ended, for messages."""
        return f"its flow run {self.flow_run_name!r} ended {self.state()}"

    def pids(self) -> list[int]:
        return []  # its processes are on another host

    def state(self, fresh: bool = False) -> str:
        """Its flow run's state type (read at most every ``STATE_TTL_S`` unless ``fresh``)."""
        if self.flow_run_id is None:
            return "CANCELLED"
        at, state = self._state
        if fresh or time.monotonic() - at > STATE_TTL_S:
            try:
                state = placed.flow_run_state(self.flow_run_id)
            except Exception:  # noqa: BLE001 - the API's hiccup is no server's death: the last
                return state  # state read stands until the next ask
            self._state = (time.monotonic(), state)
        return state

    def is_alive(self) -> bool:
        """Whether its flow run is not over (not whether vLLM answers)."""
        return self.flow_run_id is not None and self.state() not in TERMINAL

    # ------------------------------------------------------------------- start

    def spawn(self) -> None:
        """Submit the slot's flow run (as a child of the calling flow run) and return."""
        from prefect.deployments import run_deployment
        from prefect.runtime import flow_run as this_run

        if self.is_alive() and not self._cancelled:
            return
        parameters = {
            "run": self.run,
            "slot": self.slot,
            "storage": self.storage_root,
            "storage_options": self.storage_options,
            "model": list(self.model),
            "server": self.settings,
            "driver": this_run.get_id(),  # the run's flow run: the server ends with it
        }
        if self.storage_secret:
            parameters["storage_secret"] = self.storage_secret  # the block's name, no value
        flow_run = run_deployment(
            self.deployment,
            parameters=parameters,
            timeout=0,
            work_queue_name=self.queue or None,
            job_variables=self.job_variables,
            tags=["rollflow", f"rollflow-run:{self.run}", f"rollflow-server:{self.slot}"],
        )
        self.flow_run_id, self.flow_run_name = flow_run.id, flow_run.name
        self._state, self._cancelled = (0.0, "PENDING"), False
        queue = f", work queue {self.queue}" if self.queue else ""
        self.progress(
            f"inference: server {self.slot} submitted as flow run {flow_run.name!r} "
            f"({flow_run.id}) of {self.deployment}{queue}"
        )

    def start(self) -> PlacedServer:
        """Submit its flow run and wait until it serves."""
        self.spawn()
        return self.wait_ready()

    def wait_ready(self) -> PlacedServer:
        """Wait until the flow run says where it serves and vLLM answers there; raise
        ``InferenceError`` naming what did not happen otherwise (the flow run cancelled)."""
        from rollflow.services.vllm_server import answers_health  # torch: not at import

        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                state = self.state(fresh=True)
                if state in TERMINAL:
                    raise InferenceError(
                        f"vLLM server {self.slot}'s flow run ended {state} before it served; "
                        f"see {self.log_path}"
                    )
                if self._url_of_this_run() is not None and answers_health(self._url, timeout_s=2.0):
                    return self
                if time.monotonic() > deadline:
                    raise InferenceError(self._late(state))
                time.sleep(POLL_S)
        except BaseException:
            self.stop(timeout_s=10.0)
            raise

    def _url_of_this_run(self) -> str | None:
        """The URL its current flow run wrote, once written (then registered with its key)."""
        try:
            where = self.storage.read_json(slot_file(self.slot))
        except ValueError:
            return None  # being written
        if not isinstance(where, dict) or where.get("flow_run_id") != str(self.flow_run_id):
            return None
        url = where["url"].rstrip("/")
        if url != self._url:  # its first start, or a restart placed on another host
            self._url = url
            self.settings["port"] = int(url.rsplit(":", 1)[1])  # a restart asks for it again
            keys.register(url, self.api_key)
        return url

    def _late(self, state: str) -> str:
        waited = f"{self.startup_timeout_s:.0f}s"
        if state in ("SCHEDULED", "PENDING"):
            queue = f"work queue {self.queue!r}" if self.queue else "its work queue"
            return (
                f"vLLM server {self.slot}: no worker of {self.deployment}'s pool ({queue}) "
                f"started its flow run {self.flow_run_name!r} within {waited}: start a worker "
                "there (`prefect worker start --pool ... --work-queue ...`) on the server's host"
            )
        if self._url is None:
            return (
                f"vLLM server {self.slot}'s flow run ({state}) did not say where it serves "
                f"within {waited} (it copies the policy first); see {self.log_path}"
            )
        return (
            f"vLLM server {self.slot} at {self._url} did not become healthy within {waited}; "
            f"see {self.log_path}"
        )

    # -------------------------------------------------------------------- stop

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel its flow run and wait up to ``timeout_s`` for it to end (its worker stops the
        process, the guard takes vLLM with it); said when it did not end in time."""
        if self.flow_run_id is None or self.state(fresh=True) in TERMINAL:
            return
        self._cancelled = True
        placed.cancel_and_wait(
            self.flow_run_id, timeout_s, f"inference: server {self.slot}", self.progress
        )
        self.state(fresh=True)  # what it is now, not what it was before the cancel
