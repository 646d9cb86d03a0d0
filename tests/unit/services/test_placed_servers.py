"""vLLM servers as flow runs (flows/servers.py): what the run's side (``PlacedServer``) waits
for and says, the flow body's refusals, the config and the plan that place them. The whole path
(a run submitting one server to each host's worker through a real Prefect server, each serving
and syncing) is tests/integration/flows/test_scale_out.py's two-host run."""

from __future__ import annotations

import http.server
import threading
import uuid

import pytest
from placed_support import FakeFlowRuns, in_a_placed_flow_run

from rollflow.flows import inference_server
from rollflow.infra.config import load_config
from rollflow.infra.errors import ConfigError, InferenceError, ServiceError
from rollflow.infra.placement import Machine, make_plan
from rollflow.infra.processes import free_port
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet import keys
from rollflow.services import placed as toolkit
from rollflow.services import placed_server as servers

DEPLOYMENT = "rollflow-inference-server/default"


def _cfg(*overrides: str):
    return load_config(None, ["model.path='/m'", "envs=[{name='sort_letters'}]", *overrides])


@pytest.fixture
def health():
    """A server answering ``/health`` 200 on 127.0.0.1: where a placed server 'serves'."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class FakePrefect(FakeFlowRuns):
    """The submitted servers' flow runs, polled at once."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        monkeypatch.setattr(servers, "POLL_S", 0.05)


def _placed(tmp_path, startup_timeout_s: float = 5.0, queue: str = "host-1", gpus=None):
    storage = (str(tmp_path / "runs"), {})
    server = servers.PlacedServer(
        DEPLOYMENT,
        queue,
        "run",
        1,
        storage,
        ("policy", 0),
        {"reach": "192.0.2.1", "port": 0, "startup_timeout_s": startup_timeout_s},
        api_key="key",
        progress=lambda line: None,
        job_variables=gpus,
    )
    server.startup_timeout_s = startup_timeout_s  # no placement allowance in a unit test
    return server, RunStorage(*storage[:1], "run", storage[1])


def _serving(storage: RunStorage, flow_run_id, url: str) -> None:
    """What the server's flow run writes before vLLM starts."""
    storage.write_json(toolkit.slot_file(1), {"flow_run_id": str(flow_run_id), "url": url})


def test_a_placed_server_is_ready_once_its_own_flow_run_says_where_and_vllm_answers_there(
    tmp_path, monkeypatch, health
):
    api = FakePrefect(monkeypatch)
    server, storage = _placed(tmp_path, gpus={"gpus": 2})
    server.spawn()
    [asked] = api.submitted
    assert asked["job_variables"] == {"gpus": 2}  # its pool places its GPUs
    assert (asked["name"], asked["queue"], asked["slot"], asked["model"]) == (
        DEPLOYMENT,
        "host-1",
        1,
        ["policy", 0],
    )
    assert "key" not in str(asked)  # the key travels through the run's storage, not the UI
    api.states[server.flow_run_id] = "RUNNING"
    _serving(storage, uuid.uuid4(), "http://198.51.100.9:1")  # an earlier flow run's: not this one
    threading.Timer(0.3, _serving, (storage, server.flow_run_id, health)).start()
    server.wait_ready()
    assert server.url == health and server.is_alive()
    assert server.settings["port"] == int(health.rsplit(":", 1)[1])  # a restart asks for it

    # Stopped: its flow run cancelled; started again: submitted again, to the same port.
    server.stop(timeout_s=1.0)
    assert api.cancelled == [asked_id := server.flow_run_id] and not server.is_alive()
    server.spawn()
    assert server.flow_run_id != asked_id and api.submitted[-1]["server"]["port"] == int(
        health.rsplit(":", 1)[1]
    )


def test_a_restart_placed_on_another_host_serves_at_its_new_address(tmp_path, monkeypatch, health):
    """A pool that places each flow run anew (Kubernetes) may run the restart elsewhere: the
    server is ready at the address its new flow run wrote, with the run's key registered there
    (the supervisor then moves its gate and fleet entry: test_supervisor_moves.py)."""
    api = FakePrefect(monkeypatch)
    server, storage = _placed(tmp_path)
    server.spawn()
    api.states[server.flow_run_id] = "RUNNING"
    _serving(storage, server.flow_run_id, "http://192.0.2.7:8000")
    assert server._url_of_this_run() == "http://192.0.2.7:8000"
    server.stop(timeout_s=1.0)
    server.spawn()
    assert api.submitted[-1]["server"]["port"] == 8000  # asked for again
    api.states[server.flow_run_id] = "RUNNING"
    _serving(storage, server.flow_run_id, health)
    server.wait_ready()
    assert server.url == health and keys.auth_headers(health) == keys.auth_headers(health, "key")


def test_a_server_no_worker_takes_fails_naming_the_deployment_and_queue(tmp_path, monkeypatch):
    api = FakePrefect(monkeypatch)
    server, _ = _placed(tmp_path, startup_timeout_s=0.3)
    server.spawn()
    with pytest.raises(
        InferenceError, match=r"no worker of .*default's pool \(work queue 'host-1'\)"
    ):
        server.wait_ready()
    assert api.cancelled == [server.flow_run_id]


def test_a_server_whose_flow_run_failed_before_serving_says_so(tmp_path, monkeypatch):
    api = FakePrefect(monkeypatch)
    server, _ = _placed(tmp_path)
    server.spawn()
    api.states[server.flow_run_id] = "FAILED"
    with pytest.raises(
        InferenceError, match=r"vLLM server 1's flow run ended FAILED before it served"
    ):
        server.wait_ready()
    assert not server.is_alive() and "ended FAILED" in server.ended()


def test_a_server_flow_run_started_by_hand_without_the_runs_key_refuses(tmp_path, monkeypatch):
    storage = RunStorage(str(tmp_path / "runs"), "run")
    with pytest.raises(ServiceError, match=r"control/servers/key.json holds no key"):
        inference_server.serve("run", 0, storage, ("policy", 0), {"reach": "127.0.0.1"}, "id")
    toolkit.publish_key(storage, "k")
    assert toolkit.read_key(storage) == "k"
    toolkit.withdraw_key(storage)
    assert storage.read_json(toolkit.KEY_FILE) is None


def test_server_queues_name_one_queue_per_slot_of_the_servers_deployment():
    placed = _cfg(
        "inference.max_servers=2",
        f"inference.server_deployment='{DEPLOYMENT}'",
        "inference.server_queues=['host-0', 'host-1']",
        "trainer.master_addr='192.0.2.1'",
    )
    assert placed.inference.server_queues == ["host-0", "host-1"]
    with pytest.raises(ConfigError, match=r"names 1 queue\(s\) for 2 server slot\(s\)"):
        _cfg(
            "inference.max_servers=2",
            f"inference.server_deployment='{DEPLOYMENT}'",
            "inference.server_queues=['host-0']",
            "trainer.master_addr='192.0.2.1'",
        )
    with pytest.raises(ConfigError, match="inference.server_deployment is empty"):
        _cfg("inference.server_queues=['host-0']")
    with pytest.raises(ConfigError, match=r"trainer.master_addr = '127.0.0.1', a loopback"):
        _cfg(f"inference.server_deployment='{DEPLOYMENT}'")
    with pytest.raises(ConfigError, match=r"train.lora.sync = 'adapter' is not served there"):
        _cfg(
            f"inference.server_deployment='{DEPLOYMENT}'",
            "trainer.master_addr='192.0.2.1'",
            "train.lora={rank=8, sync='adapter'}",
        )


def test_placed_servers_leave_node_0s_gpus_to_the_trainer_and_join_at_its_address():
    """Each placed server runs on a host of its own: the plan gives it that host's first GPUs,
    all of node 0's go to the trainer, and the weight group's store is node 0's address."""
    cfg = _cfg(
        "inference.num_servers=2",
        f"inference.server_deployment='{DEPLOYMENT}'",
        "inference.server_queues=['gpu-a', 'gpu-b']",
        "trainer.num_ranks=8",
        "trainer.master_addr='192.0.2.1'",
    )
    plan = make_plan(cfg, Machine(gpus=8))
    assert [(s.started_by, s.queue, s.gpus) for s in plan.servers] == [
        ("prefect", "gpu-a", (0,)),
        ("prefect", "gpu-b", (0,)),
    ]
    assert plan.trainer_nodes[0].gpus == tuple(range(8)) and plan.group_host == "192.0.2.1"
    assert "queue gpu-b" in plan.render()
    with pytest.raises(Exception, match="8 GPU"):  # not placed: the servers take two of them
        make_plan(_cfg("inference.num_servers=2", "trainer.num_ranks=8"), Machine(gpus=8))


def test_a_pool_that_places_gpus_by_job_variable_is_asked_for_each_flow_runs_gpus(prefect_pools):
    """prefect.yaml's Kubernetes and Docker pools take ``gpus`` (a pod's nvidia.com/gpu limit):
    each server's flow run asks for its tensor-parallel GPUs, each node's for its ranks'; a
    process pool, whose host has its GPUs, is asked nothing."""

    prefect_pools(
        {
            "k8s": {"variables": {"properties": {"image": {}, "gpus": {}}}},
            "proc": {"variables": {"properties": {"working_dir": {}}}},
        }
    )
    on_k8s = toolkit.check_deployment("rollflow-inference-server/k8s", "k", "")
    on_hosts = toolkit.check_deployment("rollflow-inference-server/proc", "k", "")
    assert toolkit.gpu_request(on_k8s, 2) == {"gpus": 2}
    assert toolkit.gpu_request(on_hosts, 2) is None and toolkit.gpu_request(on_k8s, 0) is None


def test_a_placed_server_loads_the_runs_storage_secret_itself(tmp_path, monkeypatch):
    """``run.storage_secret``: the server's flow run gets the Secret block's name (never its
    value) and loads it on its host before it reads the run's storage."""
    api = FakePrefect(monkeypatch)
    server, storage = _placed(tmp_path)
    server.storage_secret = "creds"
    server.spawn()
    assert api.submitted[-1]["storage_secret"] == "creds"
    plain, _ = _placed(tmp_path)
    plain.spawn()
    assert "storage_secret" not in api.submitted[-1]

    in_a_placed_flow_run(monkeypatch, inference_server)
    seen = []
    monkeypatch.setattr(
        inference_server, "serve", lambda run, slot, store, *rest: seen.append(store)
    )
    asked = api.submitted[-2]
    params = {k: asked[k] for k in ("run", "slot", "storage", "storage_options", "model", "server")}
    inference_server.inference_server.fn(**params, storage_secret=asked["storage_secret"])
    assert seen[0].options["secret"] == "planted-secret"


def test_the_runs_services_hand_the_storage_secrets_name_to_its_placed_servers(
    tmp_path, monkeypatch
):
    from rollflow.services import server_maker
    from rollflow.services.run_services import RunServices

    monkeypatch.setattr(server_maker, "max_model_len", lambda policy: 64)
    cfg = _cfg(
        f"run.storage='{tmp_path}'",
        "run.storage_secret='creds'",
        "inference.server_deployment='rollflow-inference-server/default'",
        "inference.device='cpu'",  # (auto: refused, the run's host has no GPU to go by)
        "trainer.master_addr='192.0.2.1'",
    )
    run = RunServices(cfg, "/m", None, tmp_path / "logs", lambda _: None, Machine(gpus=0))
    assert run.maker.placed_server(0).storage_secret == "creds"


def test_a_placed_server_names_its_own_hosts_gpus_never_the_run_hosts(tmp_path, monkeypatch):
    """The run's host was given GPUs 4-7 (or '': a CPU host): a placed server's flow run gets
    no CUDA_VISIBLE_DEVICES from it (both servers were put on 4), only how many of its host's
    first GPUs it takes, and names them on its host against that host's own list (a worker
    given 2,3: 2); a host with none fails the flow run naming its list."""
    from rollflow.infra.placement import PlanError
    from rollflow.services import server_maker, vllm_server
    from rollflow.services.run_services import RunServices

    monkeypatch.setattr(server_maker, "max_model_len", lambda policy: 64)
    cfg = _cfg(
        f"run.storage='{tmp_path}'",
        "inference.num_servers=2",
        "inference.device='cuda'",
        "trainer.device='cpu'",
        f"inference.server_deployment='{DEPLOYMENT}'",
        "trainer.master_addr='192.0.2.1'",
    )
    for visible in ("4,5,6,7", ""):
        machine = Machine(gpus=4 if visible else 0, visible=visible)
        run = RunServices(cfg, "/m", None, tmp_path / "logs", lambda _: None, machine)
        settings = [run.maker.placed_server(slot).settings for slot in (0, 1)]
        assert [(s["env"], s["gpus"]) for s in settings] == [({}, [0]), ({}, [0])]

    class Made(Exception):
        pass

    def made(*args, **kwargs):
        raise Made(kwargs["extra_env"])

    monkeypatch.setattr(vllm_server, "InferenceServer", made)
    storage = RunStorage(str(tmp_path / "runs"), "run")
    toolkit.publish_key(storage, "k")
    monkeypatch.setattr(storage, "local_copy", lambda *args: tmp_path / "model")
    on_its_host = {**settings[1], "reach": "127.0.0.1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(Made) as server:
        inference_server.serve("run", 1, storage, ("policy", 0), on_its_host, "id")
    assert server.value.args[0] == {"CUDA_VISIBLE_DEVICES": "2"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES=''"):
        inference_server.serve("run", 1, storage, ("policy", 0), on_its_host, "id")
