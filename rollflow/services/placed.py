"""What the run's side and a placed process's flow run share: Prefect flow runs of a deployment
used as processes, and where a placed process finds what the run tells it.

Owns: the states that end a flow run (``TERMINAL``), reading, cancelling and waiting for a flow
run, a placed process's end when its run's flow run ends (``DriverWatch``), following a process's
log to its end (``follow_to_its_end``), what a deployment's pool takes (``check_deployment``,
``gpu_request``), and the files in the run's storage through which the run and its placed
processes meet: the run's key (``KEY_FILE``: ``publish_key`` / ``read_key`` / ``withdraw_key``),
where trainer node 0 serves (``NODE_0_FILE``) and where server ``slot`` serves (``slot_file``).

Both sides import this module: the flow bodies (``flows/trainer_node.py``,
``flows/inference_server.py``, run by a worker on another host) and the run's handles on them
(``placed_trainer.py``, ``placed_server.py``). It imports no torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from uuid import UUID

from rollflow.infra.errors import ServiceError
from rollflow.infra.processes import ManagedProcess
from rollflow.infra.storage import RunStorage
from rollflow.infra.terminal import say

FOLLOW_INTERVAL_S = 0.5


TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


NODE_0_FILE = "control/trainer/node-0.json"  # where node 0's flow run serves, in run storage


KEY_FILE = "control/servers/key.json"  # the run's key, for its placed processes' flow runs


# Beyond a placed process's own start-up deadline: a worker's poll, the flow run's start (a
# placed server's: the policy's copy too).
PLACEMENT_S = 120.0


DRIVER_CHECK_S = 10.0  # how often a node reads its run's flow run's state


def slot_file(slot: int) -> str:
    """Where the flow run of server ``slot`` writes where it serves, in the run's storage."""
    return f"control/servers/{slot}.json"


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


# A placed process's SIGTERM-to-SIGKILL wait when its flow run ends: well within the 30 s
# Prefect's worker gives a cancelled flow run before it SIGKILLs it (the guard then still takes
# the service, but this owner's own stop is the one that says so).
STOP_S = 15.0


def follow_to_its_end(proc: ManagedProcess, what: str, watch: DriverWatch | None = None) -> int:
    """Say each line of the started ``proc``'s log until it exits (or ``watch`` sees the run's
    flow run over), stop what is left of it; return its exit code 0, else raise
    ``ServiceError`` naming ``what``, the code and the log's last lines (its flow run ends
    Failed)."""
    over = watch.over if watch is not None else lambda: False
    try:
        follow_log(proc.log_path, lambda: proc.is_alive() and not over(), say)
    finally:
        proc.stop(timeout_s=STOP_S)
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


def read_key(storage: RunStorage) -> str:
    """The run's key (its servers' and trainer's API key), as the run published it."""
    try:
        record = storage.read_json(KEY_FILE)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not record.get("key"):
        raise ServiceError(
            f"{storage.path(KEY_FILE)} holds no key: the run writes it when it starts the flow "
            "runs of its servers and trainer nodes; was this flow run started by hand? Start "
            "the run instead"
        )
    return record["key"]


def publish_key(storage: RunStorage, key: str) -> None:
    """Give the run's placed servers and trainer node 0 their key through the run's storage
    (see the module docstring)."""
    storage.write_json(KEY_FILE, {"key": key})


def withdraw_key(storage: RunStorage) -> None:
    """The run's placed processes are gone: their key leaves the storage (best effort)."""
    try:
        storage.fs.rm(storage.path(KEY_FILE))
    except (FileNotFoundError, OSError):
        pass


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


def policy_in_storage(
    storage: RunStorage, policy_dir: str, checkpoint_step: int | None, progress=print
) -> tuple[str, int]:
    """Where processes on other hosts (trainer nodes, placed vLLM servers) find the policy in the
    run's storage, as (kind, step): ``checkpoint_step``'s checkpoint (the one being resumed),
    else the policy itself, put there once."""
    if checkpoint_step:
        return ("checkpoints", checkpoint_step)
    if 0 not in storage.committed_steps("policy"):
        progress(
            f"services: putting the policy in {storage.step_uri('policy', 0)} for the "
            "processes on other hosts"
        )
        storage.upload_dir(policy_dir, "policy", 0)
    return ("policy", 0)
