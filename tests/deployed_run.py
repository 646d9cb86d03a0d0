"""A run made the way a Prefect user makes one: a real ``prefect server``, ``rollflow deploy``,
a process worker, and ``prefect deployment run 'rl-run/quickstart' -p overrides=[...]``.

While it runs, the fleet's action (``rollflow-scale/fleet``) asks it for its one server, and once
step 1 is committed its host is lost: the worker and every process under it SIGKILLed at once,
so nobody reports anything. The silent-run automation marks the flow run Crashed after 3 missed
heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` = 30 s, Prefect's least), the heal automation
reruns it (``rollflow-heal/crashed-run``), and a second worker (another host of the pool) runs
the rerun, which resumes after step 1 and completes. While the server waits out the missed
heartbeats, a user runs one step from the deployment's run form in Chromium, on the second
worker. The record is of the rerun, with the step flow runs of both. (A process lost without
its host, e.g. OOM-killed, is reported Crashed by its worker at once, Prefect's own doing; the
heal chain after it is the same.)

``make_deployed_run`` does all of it once per test session (tests/conftest.py, ``deployed_run``),
records what the tests check (the flow run, its artifacts read back through the client, the
processes left after the stop) and stops everything it started before returning.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from uuid import UUID

import httpx
import psutil
import yaml

from rollflow.infra import http
from rollflow.infra.prefect_server import server_command
from rollflow.infra.prefect_ui import server_env
from rollflow.infra.processes import free_port
from rollflow.testing.browser import FormRun

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
RUN_DEADLINE_S = 420
HEARTBEAT_S = 30  # the flow runs' heartbeat interval: Prefect's least
# Quickstart made tiny: a smaller model, a short warm start, 2 steps of 8 prompts x 4 samples.
TINY = [
    "run.num_steps=2",
    "run.eval_every=0",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "model.warm_start_target=0.3",
    "model.warm_start_max_steps=50",
    "sampling.group_size=4",
    "sampling.num_eval_prompts=16",
]
# Given as the form's `train` section, in part (`-p train='{...}'`): laid over the deployment's.
TINY_TRAIN = {"train_batch_size": 8, "mini_batch_size": 4}


@dataclass
class DeployedRun:
    storage: Path  # run.storage of the run
    run: str  # run.name
    deploy_output: str
    flow_run: dict  # name, state, id of the deployment's flow run
    step_flow_runs: list[dict]  # name and id of each step flow run under it
    artifacts: list[dict]  # key, type, description, data, flow_run_id: read back through the client
    pools: dict[str, str]  # every pool of prefect.yaml: name -> type, as the server holds it
    redeploy_output: list[str]  # a second `rollflow deploy`, after the run
    deployments: list[str]  # flow/deployment names on the server after it
    scale_flow_run: dict = field(default_factory=dict)  # rollflow-scale/fleet's, during the run
    # rl-run/quickstart as the server holds it: its parameter schema (the run form) and parameters
    form_schema: dict = field(default_factory=dict)
    form_run: FormRun | None = None  # a run submitted from the form in Chromium (None: no Chromium)
    form_parameters: dict = field(default_factory=dict)
    flow_run_parameters: dict = field(default_factory=dict)  # the deployment's flow run's
    # the flow run lost with its host: id, state, message, seconds from the loss to Crashed and
    # to the rerun's flow run
    crashed: dict = field(default_factory=dict)
    heal_flow_runs: list[dict] = field(default_factory=list)  # rollflow-heal's: state, name
    mirrored: list[str] = field(default_factory=list)  # the run's events, as the server holds them
    reruns: int = 0  # flow runs started for the crash
    fleet_control: dict | None = None  # control/fleet.json after it
    left_over: list[str] = field(default_factory=list)  # processes of the test alive after the stop
    groups_alive: list[str] = field(default_factory=list)  # process groups alive after the stop

    @property
    def run_dir(self) -> Path:
        return self.storage / self.run


class Service:
    """A command in its own process group, logging to a file; stop() ends the whole group."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]):
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def stop(self, grace_s: float = 20) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Prefect's CLI shuts down cleanly on Ctrl-C
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def tail(self, num_chars: int = 4000) -> str:
        return f"--- {self.name} log ({self.log}) ---\n{self.log.read_text(errors='replace')[-num_chars:]}"


def processes_marked(marker: str) -> list[psutil.Process]:
    """Live processes whose command line or environment mentions ``marker`` (our tmp folder)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " ".join((p.info["environ"] or {}).values())
        except (psutil.Error, TypeError):
            continue
        if marker in text and p.pid != os.getpid():
            found.append(p)
    return found


def wait_until(predicate, deadline_s: float, what: str, logs=lambda: "") -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not within {deadline_s:.0f}s\n{logs()}")
        time.sleep(0.5)


def make_deployed_run(tmp: Path) -> DeployedRun:
    from run_support import seeded_prefect_home  # (not at import: conftest imports this file)

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(seeded_prefect_home(tmp / "prefect-home")),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # each step's flow run waits for a poll
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),  # and the silent-run automation's
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    services: list[Service] = []
    lost: list[Service] = []  # a worker lost with its host: no longer expected alive
    logs = lambda: "\n".join(s.tail() for s in services)  # noqa: E731
    record = None
    try:
        server = Service(
            "prefect server",
            server_command("127.0.0.1", port, log_level="warning"),  # rollflow ui's, its UI on
            tmp / "server.log",
            {**env, **server_env("127.0.0.1", port)},
        )
        services.append(server)
        wait_until(
            lambda: _healthy(api) or server.proc.poll() is not None,
            180,
            "prefect server healthy",
            logs,
        )
        assert server.proc.poll() is None, f"prefect server exited\n{logs()}"

        deploy_output = rollflow_deploy(env, "configs/quickstart.toml")

        def start_worker(name: str) -> Service:
            argv = [*PREFECT, "worker", "start", "--pool", "rollflow-cpu", "--type", "process"]
            worker = Service(name, [*argv, "--name", name], tmp / f"{name}.log", env)
            services.append(worker)
            return worker

        worker = start_worker("test-worker")

        storage = tmp / "runs"
        overrides = [f"run.storage={storage}", f"model.cache_dir={tmp / 'models'}", *TINY]
        flow_run_id = _deployment_run(
            env,
            "rl-run/quickstart",
            f"overrides={json.dumps(overrides)}",
            f"train={json.dumps(TINY_TRAIN)}",
        )

        def ended(run_id: str) -> dict | None:
            for service in services:
                if service not in lost:
                    assert service.proc.poll() is None, f"{service.name} exited\n{logs()}"
            state = prefect_api(api, f"/flow_runs/{run_id}")["state"]
            terminal = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            return state if state is not None and state["type"] in terminal else None

        def finished() -> bool:
            return ended(flow_run_id) is not None

        # The fleet's Prefect action while the run runs: ask it for the one server it has (a
        # grow is tested on real vLLM in test_chaos_run; here, the action's path through Prefect).
        config_json = storage / "quickstart" / "config.json"
        wait_until(lambda: config_json.exists() or finished(), 180, "the run's config.json", logs)
        scale_run_id = _deployment_run(
            env, "rollflow-scale/fleet", "run=quickstart", "servers=1", f"storage={storage}"
        )

        # The run's host lost once step 1's flow run completed (its checkpoint is committed
        # before the flow run ends: a kill in between left it unfinished) and before step 2
        # commits: its worker and every process under it (the run flow's, its services)
        # SIGKILLed at once, so nobody reports anything. Step 2 overlaps step 1's tail (it
        # trains once step 1 has) and, with vLLM on one thread, committed before step 1's flow
        # run completed (seen, though the host ran in 20 ms slices between two looks). So at
        # step 1's checkpoint vLLM is stopped (SIGSTOP): step 1 needs it no more (its sync came
        # before its checkpoint), and step 2 cannot commit before its own sync. Once step 1's
        # flow run completed, the whole host is frozen, then killed.
        step_1 = storage / "quickstart" / "checkpoints" / "step=1" / "_SUCCESS"
        _wait_for_file(step_1, RUN_DEADLINE_S, "step 1's checkpoint", finished)
        held = _inference_processes(worker)
        _signal_all(held, signal.SIGSTOP)
        wait_until(
            lambda: _step_completed(api, flow_run_id, "quickstart-step-1") or finished(),
            120,
            "step 1's flow run completed",
            logs,
        )
        _signal_all(_host_processes(worker), signal.SIGSTOP)
        assert held, "no vLLM server under the run's host to hold"
        assert _heartbeat_sent(api, flow_run_id), "the run sent no heartbeat: nothing to miss"
        assert not ended(flow_run_id), f"the run ended before its host could be lost\n{logs()}"
        assert not (step_1.parent.parent / "step=2" / "_SUCCESS").exists()
        lost.append(worker)
        _kill_host(worker)
        lost_at = time.time()
        start_worker("test-worker-2")  # another host of the pool
        # A user's run from the run form in a real browser, on the same server and the new
        # worker, while the server waits out the lost run's missed heartbeats (the silence lasts
        # 3 heartbeats whatever else runs: it was 90 s of the fixture's idle time).
        form_run = _run_from_the_form(api, tmp / "shots", overrides, ended, logs)
        silent_s = 3 * HEARTBEAT_S
        wait_until(lambda: ended(flow_run_id), silent_s + 90, "the lost run marked Crashed", logs)
        crashed_after_s = _seconds_since(lost_at, ended(flow_run_id)["timestamp"])
        rerun_tag = f"rollflow-rerun-of:{flow_run_id}"
        wait_until(lambda: _tagged(api, rerun_tag), 120, "the heal automation's rerun", logs)
        rerun_id = _tagged(api, rerun_tag)[0]["id"]
        rerun_after_s = _seconds_since(
            lost_at, prefect_api(api, f"/flow_runs/{rerun_id}")["created"]
        )
        wait_until(lambda: ended(rerun_id), RUN_DEADLINE_S, "the rerun finished", logs)
        wait_until(lambda: ended(scale_run_id), 120, "the fleet action's flow run finished", logs)
        record = _read_back(api, rerun_id, storage, deploy_output, earlier=[flow_run_id])
        record.form_run = form_run
        assert record.flow_run["state"] == "COMPLETED", f"{record.flow_run}\n{logs()}"
        crashed = ended(flow_run_id)
        record.crashed = {
            "id": flow_run_id,
            "state": crashed["type"],
            "message": crashed["message"],
            "crashed_after_s": crashed_after_s,
            "rerun_after_s": rerun_after_s,
            "rerun_worker": prefect_api(api, f"/flow_runs/{rerun_id}").get("work_queue_name"),
        }
        record.heal_flow_runs = _heal_flow_runs(api)
        record.mirrored = _run_events(api, "quickstart")
        record.reruns = len(_tagged(api, rerun_tag))
        state = ended(scale_run_id)
        record.scale_flow_run = {"state": state["type"], "message": state.get("message")}
        control = storage / "quickstart" / "control" / "fleet.json"
        record.fleet_control = json.loads(control.read_text()) if control.exists() else None
    finally:
        for service in reversed(services):  # the worker before the server it reports to
            service.stop()
    # Services of the run die with its flow run process; give stragglers a bounded while.
    end = time.monotonic() + 30
    while processes_marked(str(tmp)) and time.monotonic() < end:
        time.sleep(0.5)
    record.left_over = [" ".join(p.cmdline())[:200] for p in processes_marked(str(tmp))]
    record.groups_alive = [s.name for s in services if s.group_alive()]
    return record


FORM_RUN = "from-the-form"  # its run.name, typed into the form


def _seconds_since(wall_s: float, timestamp: str) -> float:
    """Seconds from ``wall_s`` (``time.time()``) to an API timestamp (ISO 8601, with its zone)."""
    return datetime.fromisoformat(timestamp).timestamp() - wall_s


def _run_from_the_form(api: str, shots: Path, overrides: list[str], ended, logs) -> FormRun | None:
    """Open rl-run/quickstart's run form in Chromium, read it, type a new run's name and one
    step into its typed fields and the test's overrides into its list, submit it, and follow
    the flow run the worker runs to its end: screenshots of the form, the running run, the
    finished run and its artifacts. None where no Chromium is installed (.ci/run installs it)."""
    from rollflow.testing.browser import (
        browser,
        chromium,
        deployment_id,
        shoot_artifact,
        shoot_flow_run,
        submit_run_form,
        wait_for,
    )

    if chromium() is None:
        return None
    ui = api.removesuffix("/api")
    tiny = [o for o in overrides if not o.startswith("run.num_steps=")]
    tiny += [f"train.{k}={v}" for k, v in TINY_TRAIN.items()]
    with browser() as page:
        run = submit_run_form(
            page,
            ui,
            api,
            deployment_id(api, "rl-run/quickstart"),
            {"Name (Optional)": FORM_RUN, "Num Steps (Optional)": "1"},
            tiny,
            shots,
            read=("Num Steps (Optional)", "Lr (Optional)", "Name (Optional)"),
        )
        state = lambda: (prefect_api(api, f"/flow_runs/{run.flow_run_id}")["state"] or {}).get(  # noqa: E731
            "type"
        )
        wait_for(
            lambda: state() != "SCHEDULED" and state() != "PENDING", 120, "the form's run started"
        )
        run.shots.append(shots / "running-run.png")
        shoot_flow_run(page, ui, run.flow_run_id, run.shots[-1])
        try:
            wait_for(lambda: ended(run.flow_run_id), RUN_DEADLINE_S, "the form's run ended")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        run.shots.append(shots / "finished-run.png")
        shoot_flow_run(page, ui, run.flow_run_id, run.shots[-1])
        run.shots.append(shots / "finished-run-artifacts.png")
        run.artifacts_text = shoot_flow_run(
            page, ui, run.flow_run_id, run.shots[-1], tab="Artifacts"
        )
        run.shots.append(shots / "curves-artifact.png")
        run.plot_width = shoot_artifact(page, ui, api, f"{FORM_RUN}-curves", run.shots[-1])
        run.state = state()
    return run


def _heartbeat_sent(api: str, flow_run_id: str) -> bool:
    """Whether the flow run sent a heartbeat event (the silent-run automation waits for one)."""
    found = prefect_api(
        api,
        "/events/filter",
        {
            "filter": {
                "event": {"name": ["prefect.flow-run.heartbeat"]},
                "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
            },
            "limit": 1,
        },
    )
    return bool(found["events"])


def _host_processes(worker: Service) -> list[psutil.Process]:
    """The worker and every process under it (the run's flow run, its services)."""
    root = psutil.Process(worker.proc.pid)
    return [root, *root.children(recursive=True)]


def _inference_processes(worker: Service) -> list[psutil.Process]:
    """The vLLM servers under the worker (their API servers) and every process under them."""
    held = []
    for proc in _host_processes(worker):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "vllm.entrypoints.openai.api_server" in proc.cmdline():
                held += [proc, *proc.children(recursive=True)]
    return held


def _wait_for_file(path: Path, deadline_s: float, what: str, finished) -> None:
    """Until ``path`` exists, looking every 10 ms (``wait_until``'s 0.5 s naps are long beside a
    step), and at the run's state every 0.5 s: a run that ended without it fails here."""
    end = time.monotonic() + deadline_s
    next_look = 0.0
    while not path.exists():
        now = time.monotonic()
        if now > end:
            raise TimeoutError(f"{what} not within {deadline_s:.0f}s")
        if now > next_look:
            assert not finished(), f"the run ended before {what}"
            next_look = now + 0.5
        time.sleep(0.01)


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def _kill_host(worker: Service) -> None:
    """A host lost: its worker and every process under it SIGKILLed at once; nothing is left
    to report."""
    every = _host_processes(worker)
    _signal_all(every, signal.SIGKILL)
    psutil.wait_procs(every, timeout=10)


def rollflow_deploy(env: dict[str, str], config: str | Path) -> str:
    """`rollflow deploy CONFIG` against the server of ``env``, as a user types it; its output."""
    return _command([sys.executable, "-m", "rollflow.cli", "deploy", str(config)], env)


def _command(argv: list[str], env: dict[str, str]) -> str:
    """``argv`` from the repository root with ``env``, which must succeed; its output."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _healthy(api: str) -> bool:
    try:
        # The process's shared client: httpx.get builds a TLS context per call (~70 ms of CPU).
        return http.client().get(f"{api}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def prefect_api(
    api: str, path: str, payload: dict | None = None, *, try_s: float = 30, deadline_s: float = 120
):
    """The test's own read of the Prefect API (GET ``path``, or POST ``payload`` to it): its JSON.

    The server (SQLite) shares two cores with the whole suite, its runs' processes and their writes,
    so one answer can take longer than a live process's deadline would allow: a timeout, a dropped
    connection or a 503 is tried again (each try ``try_s``) until ``deadline_s``, then raised
    naming the path. Any other error status is raised at once."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            response = http.client().request(
                "GET" if payload is None else "POST", f"{api}{path}", json=payload, timeout=try_s
            )
            if response.status_code != 503:
                response.raise_for_status()
                return response.json()
            why = f"HTTP 503: {response.text[:200]}"
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() + 1 > end:
            raise TimeoutError(f"Prefect API {path}: no answer within {deadline_s:.0f}s ({why})")
        time.sleep(1)


def flow_run_log(api: str, *flow_run_ids: str) -> str:
    """Every line the flow runs ``flow_run_ids`` logged to the Prefect API, in time order."""
    lines: list[str] = []
    while True:
        page = prefect_api(
            api,
            "/logs/filter",
            {
                "logs": {"flow_run_id": {"any_": list(flow_run_ids)}},
                "sort": "TIMESTAMP_ASC",
                "offset": len(lines),
                "limit": 200,
            },
        )
        lines += [entry["message"] for entry in page]
        if len(page) < 200:
            return "\n".join(lines)


def _deployment_run(env: dict[str, str], deployment: str, *params: str) -> str:
    """`prefect deployment run DEPLOYMENT -p PARAM ...`, as a user types it; the flow run's id."""
    out = _command(
        [*PREFECT, "deployment", "run", deployment, *(a for p in params for a in ("-p", p))], env
    )
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def _step_completed(api: str, parent_id: str, name: str) -> bool:
    runs = prefect_api(
        api,
        "/flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}, "name": {"any_": [name]}}},
    )
    return any(r["state"] and r["state"]["type"] == "COMPLETED" for r in runs)


def _tagged(api: str, tag: str) -> list[dict]:
    return prefect_api(api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [tag]}}})


def _run_events(api: str, run: str) -> list[str]:
    """The names of the run's events (``rollflow.<kind>``) the server received, oldest first."""
    found = prefect_api(
        api,
        "/events/filter",
        {
            "filter": {
                "resource": {"id": [f"rollflow.run.{run}"]},
                "order": "ASC",
            },
            "limit": 50,  # the most the server returns in one page
        },
    )
    return [e["event"] for e in found["events"]]


def _heal_flow_runs(api: str) -> list[dict]:
    runs = prefect_api(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["rollflow-heal"]}}})
    return [{"state": r["state"]["type"], "name": r["name"]} for r in runs]


def _read_back(
    api: str, flow_run_id: str, storage: Path, deploy_output: str, earlier: list[str] = ()
) -> DeployedRun:
    """What the tests check, read through the Prefect client while the server still runs: the
    flow run ``flow_run_id``, and the completed step flow runs under it and the ``earlier``
    flow runs of the run (those a crash cut short)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rollflow.flows.deploy import deploy
    from rollflow.infra.work_pools import ensure_work_pool

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        parent = client.read_flow_run(flow_run_id)
        steps = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(
                    any_=[parent.id, *map(UUID, earlier)]
                )
            )
        )
        steps = [s for s in steps if s.state is not None and s.state.is_completed()]
        run_ids = {parent.id, *(s.id for s in steps)}
        artifacts = [
            {
                "key": a.key,
                "type": a.type,
                "description": a.description,
                "data": a.data,
                "flow_run_id": a.flow_run_id,
            }
            for a in client.read_artifacts()
            if a.flow_run_id in run_ids
        ]
        # The GPU pools are not used by the quickstart: create them too, so the server validates
        # every template of prefect.yaml (placeholders must name declared variables).
        for pool in yaml.safe_load((ROOT / "prefect.yaml").read_text())["definitions"][
            "work_pools"
        ].values():
            ensure_work_pool(client, pool, ROOT)
        pools = {p.name: p.type for p in client.read_work_pools()}
        redeploy: list[str] = []
        deploy(ROOT / "prefect.yaml", out=redeploy.append)
        form = client.read_deployment_by_name("rl-run/quickstart")
        flows = {f.id: f.name for f in client.read_flows()}
        deployments = sorted(f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments())
    return DeployedRun(
        storage=storage,
        run="quickstart",
        deploy_output=deploy_output,
        flow_run={
            "id": str(parent.id),
            "name": parent.name,
            "state": parent.state.type.value,
            "tags": list(parent.tags),
        },
        step_flow_runs=sorted(
            ({"name": s.name, "id": s.id} for s in steps), key=lambda s: s["name"]
        ),
        artifacts=artifacts,
        pools=pools,
        redeploy_output=redeploy,
        deployments=deployments,
        form_schema=form.parameter_openapi_schema,
        form_parameters=form.parameters,
        flow_run_parameters=parent.parameters,
    )
