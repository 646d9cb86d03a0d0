"""Servers started before the run (``inference.urls``, ``ROLLFLOW_VLLM_URLS``): the config's
checks, the plan, the key, and the readiness check against a server that answers over HTTP (a
small local one standing in for vLLM's routes; the real run on the suite's shared vLLM server is
tests/integration/flows/test_your_own_task.py)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from rollflow.inference import protocol
from rollflow.infra.config import ConfigError, load_config
from rollflow.infra.errors import InferenceError
from rollflow.infra.placement import Machine, make_plan
from rollflow.services.run_services import RunServices
from rollflow.services.started_server import StartedServer

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "configs" / "quickstart.toml"
URL = "http://127.0.0.1:8000"


def config(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


def test_the_environment_names_the_servers_where_the_config_names_none(monkeypatch):
    monkeypatch.setenv("ROLLFLOW_VLLM_URLS", f"{URL}/, http://127.0.0.1:8001")
    assert config().inference.urls == [URL, "http://127.0.0.1:8001"]
    assert config().inference.num_servers == 2  # the run uses every server named
    given = config('inference.urls=["http://127.0.0.1:9000"]')
    assert given.inference.urls == ["http://127.0.0.1:9000"]  # the config's own win
    monkeypatch.delenv("ROLLFLOW_VLLM_URLS")
    assert config().inference.urls == []


@pytest.mark.parametrize(
    "overrides, named",
    [
        (['inference.urls=["127.0.0.1:8000"]'], "not a server's base URL"),
        ([f'inference.urls=["{URL}", "{URL}/"]'], "names a server twice"),
        ([f'inference.urls=["{URL}"]', "inference.max_servers=2"], "inference.max_servers"),
        ([f'inference.urls=["{URL}"]', "inference.num_servers=3"], "inference.num_servers = 3"),
        ([f'inference.urls=["{URL}"]', 'inference.server_deployment="a/b"'], "server_deployment"),
        (['inference.urls=["http://192.0.2.3:8000"]'], "trainer.master_addr = '127.0.0.1'"),
        (
            [f'inference.urls=["{URL}"]', "train.lora.rank=8", 'train.lora.sync="adapter"'],
            "train.lora.sync = 'adapter'",
        ),
    ],
)
def test_a_config_that_cannot_use_the_servers_names_the_keys(overrides, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        config(*overrides)


def test_the_plan_starts_no_server_and_says_where_each_serves():
    cfg = config('inference.urls=["http://192.0.2.3:8000"]', 'trainer.master_addr="192.0.2.9"')
    on_gpus = Machine(gpus=2, cpus=16, cores=tuple(range(16)), driver_gpus=2)
    plan = make_plan(cfg, on_gpus)
    [server] = plan.servers
    assert server.started_by == "you" and server.url == "http://192.0.2.3:8000"
    assert server.gpus == () and server.env == {}  # its GPUs are its own host's
    assert server.device == "cuda" and plan.wire.backend == "nccl"
    assert plan.group_host == "192.0.2.9"  # its workers join the weight group there
    assert "http://192.0.2.3:8000" in plan.render()
    [node] = plan.trainer_nodes
    assert node.gpus == (0,)  # the machine's GPUs are the trainer's alone


def test_without_the_key_the_run_refuses_before_any_process_starts(monkeypatch, tmp_path):
    monkeypatch.delenv(protocol.KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=protocol.KEY_ENV):
        RunServices(config(f'inference.urls=["{URL}"]'), tmp_path, None, tmp_path)


def test_with_the_key_it_is_the_runs_own(monkeypatch, tmp_path):
    """The trainer's weight group admits the servers' workers by the run's key, which they hold:
    the key they were started with."""
    monkeypatch.setenv(protocol.KEY_ENV, "their-key")
    services = RunServices(config(f'inference.urls=["{URL}"]'), tmp_path, None, tmp_path)
    assert services.token == "their-key"
    supervisor = services.maker(0)
    assert isinstance(supervisor.server, StartedServer) and supervisor.url == URL


class FakeVllm(http.server.BaseHTTPRequestHandler):
    """vLLM's /health and /v1/models behind a key, serving ``served`` (class attributes)."""

    key, served = "k", ["policy"]

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.end_headers()
            return
        body = {"data": [{"id": name} for name in self.served]}
        payload = json.dumps(body).encode() if self.path == protocol.MODELS.path else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllm():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    FakeVllm.served = ["policy"]


def test_a_server_that_serves_the_policy_with_the_key_is_ready(fake_vllm):
    server = StartedServer(fake_vllm, "k", 0, startup_timeout_s=5)
    assert server.wait_ready() is server and server.is_alive()
    server.stop()  # leaves it serving
    assert StartedServer(fake_vllm, "k", 0, startup_timeout_s=5).wait_ready()


@pytest.mark.parametrize(
    "key, served, named",
    [
        ("wrong", ["policy"], f"refuses the key in {protocol.KEY_ENV} (401)"),
        ("k", ["Qwen/Qwen3-0.6B"], "--served-model-name policy"),
    ],
)
def test_a_server_not_ready_for_the_run_is_named_at_the_deadline(fake_vllm, key, served, named):
    FakeVllm.served = served
    with pytest.raises(InferenceError, match=r"vLLM server 0 at .* not ready within") as raised:
        StartedServer(fake_vllm, key, 0, startup_timeout_s=0.5).wait_ready()
    assert named in str(raised.value)
