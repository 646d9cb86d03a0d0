"""Trainer nodes as flow runs (flows/trainer_node.py): the node's flow body, the log it forwards,
node 0's side of the run (``PlacedTrainer``), and the config that places them. The whole path (a run submitting node 1 to a worker on another
host, through a real Prefect server) is tests/integration/flows/test_scale_out.py's two-node run."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid

import pytest
from placed_support import FakeFlowRuns, in_a_placed_flow_run

from rollflow.flows import trainer_node
from rollflow.infra.config import load_config
from rollflow.infra.errors import ConfigError, ServiceError
from rollflow.infra.placement import Machine, make_plan, resolve_addresses
from rollflow.infra.storage import RunStorage
from rollflow.services import placed as toolkit
from rollflow.services import placed_trainer as nodes


def test_the_log_is_followed_line_by_line_to_the_end(tmp_path):
    log = tmp_path / "node.log"
    alive, lines = threading.Event(), []
    alive.set()

    def write() -> None:
        with open(log, "wb", buffering=0) as out:
            out.write(b"rank 0: waiting for the rendezvous\nrank 0: half a li")
            time.sleep(0.3)
            out.write(b"ne\nrank 0: ended")  # the last line has no newline
        alive.clear()

    writer = threading.Thread(target=write)
    writer.start()
    toolkit.follow_log(log, alive.is_set, lines.append, interval_s=0.05)
    writer.join()
    assert lines == ["rank 0: waiting for the rendezvous", "rank 0: half a line", "rank 0: ended"]


@pytest.fixture
def flow_logger(monkeypatch):
    """The flow body outside a flow run: the lines it says, kept."""
    kept: list[str] = []
    monkeypatch.setattr(trainer_node, "say", kept.append)
    monkeypatch.setattr(toolkit, "say", kept.append)
    return kept


def test_a_node_runs_to_its_end_and_its_lines_reach_the_flow_runs_log(flow_logger):
    code = "import os; print('node', os.environ['NODE_ENV'])"
    out = trainer_node._run_node("r", 1, [sys.executable, "-c", code], {"NODE_ENV": "given"})
    assert out == {"run": "r", "node": 1, "exit_code": 0}
    assert "node given" in flow_logger


def test_a_node_that_fails_fails_its_flow_run_naming_the_node_and_its_last_lines(flow_logger):
    code = "import sys; print('rendezvous timed out'); sys.exit(3)"
    with pytest.raises(ServiceError, match=r"trainer node 1 of run r exited with code 3") as err:
        trainer_node._run_node("r", 1, [sys.executable, "-c", code])
    assert "rendezvous timed out" in str(err.value) and "rendezvous timed out" in flow_logger


def test_a_node_whose_runs_flow_run_ended_stops_with_it(flow_logger, monkeypatch):
    """The run's host lost: its flow run is marked Crashed, and a node on another host (whose
    ranks would idle for good, holding their devices) stops within its next read of it; the
    Prefect API not answering is no end."""
    driver, reads = str(uuid.uuid4()), []

    def state(flow_run_id):
        reads.append(flow_run_id)
        if len(reads) == 1:
            raise OSError("connection refused")  # a hiccup: the node goes on
        return "RUNNING" if len(reads) < 3 else "CRASHED"

    monkeypatch.setattr(toolkit, "flow_run_state", state)
    idle = "import time; print('rank 0 idle', flush=True); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(ServiceError, match=rf"its run's flow run \({driver}\) ended CRASHED"):
        trainer_node._run_node(
            "r", 1, [sys.executable, "-c", idle], None, toolkit.DriverWatch(driver, interval_s=0.2)
        )
    assert time.monotonic() - start < 30 and len(reads) == 3 and str(reads[0]) == driver
    assert "rank 0 idle" in flow_logger
    assert not toolkit.DriverWatch(None).over()  # a node started outside a run's flow run


def _cfg(*overrides: str):
    return load_config(None, ["model.path='/m'", "envs=[{name='sort_letters'}]", *overrides])


def test_node_queues_name_one_queue_per_node_of_the_nodes_deployment():
    placed = _cfg(
        "trainer.num_nodes=3",
        "trainer.master_addr=auto",
        "trainer.node_deployment='rollflow-trainer-node/default'",
        "trainer.node_queues=['host-0', 'host-1', 'host-2']",
    )
    assert placed.trainer.node_queues == ["host-0", "host-1", "host-2"]
    # The queues of nodes 1.. only (what they named before node 0 was a flow run too).
    with pytest.raises(
        ConfigError,
        match=r"names 2 queue\(s\) for trainer.num_nodes = 3 .*"
        "node 0's first",
    ):
        _cfg(
            "trainer.num_nodes=3",
            "trainer.master_addr=auto",
            "trainer.node_deployment='rollflow-trainer-node/default'",
            "trainer.node_queues=['host-1', 'host-2']",
        )
    with pytest.raises(ConfigError, match="trainer.node_deployment is empty"):
        _cfg("trainer.num_nodes=2", "trainer.node_queues=['host-0', 'host-1']")
    # The nodes meet node 0 on another host: not at a loopback address.
    with pytest.raises(ConfigError, match=r"trainer.master_addr = '127.0.0.1', a loopback .*auto"):
        _cfg("trainer.node_deployment='rollflow-trainer-node/default'")


def test_every_node_of_a_trainer_placed_by_prefect_is_a_flow_run_with_its_hosts_gpus():
    """Node 0 too: started by Prefect on its queue, its GPUs its own host's first ones (none of
    this machine's, which may have none), the weight group's store at its address."""
    cfg = _cfg(
        "trainer.num_nodes=2",
        "trainer.num_ranks=2",
        "trainer.device='cuda'",
        "inference.device='cpu'",
        "trainer.master_addr='node-0.svc'",
        "trainer.node_deployment='rollflow-trainer-node/gpu'",
        "trainer.node_queues=['a', 'b']",
    )
    plan = make_plan(cfg, Machine(gpus=0, nodes=2))
    assert [(p.node, p.started_by, p.queue, p.gpus, p.env) for p in plan.trainer_nodes] == [
        (0, "prefect", "a", (0, 1), {}),  # positions in its host's list, which it names there
        (1, "prefect", "b", (0, 1), {}),
    ]
    # A pool's GPUs 4-7 on this host are not the nodes': neither node is put on 4,5.
    pooled = make_plan(cfg, Machine(gpus=4, nodes=2, visible="4,5,6,7"))
    assert [p.env for p in pooled.trainer_nodes] == [{}, {}]
    assert plan.group_host == "node-0.svc"
    # "auto" is node 0's own host's address, which its flow run finds: not this host's.
    auto = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"master_addr": "auto"})}
    )
    assert resolve_addresses(auto) is auto
    shown = make_plan(auto, Machine(gpus=0, nodes=2)).render()
    assert "store on node 0's host (auto: its flow run finds the address)" in shown
    # vLLM beside the run is on the run's host, not on "node 0", which is elsewhere.
    assert re.search(r"^vllm-0 +run's host ", shown, re.M), shown
    assert re.search(r"^trainer-node-0 +queue a ", shown, re.M), shown
    here = make_plan(
        _cfg("trainer.num_nodes=2", "trainer.master_addr='192.0.2.1'"), Machine(gpus=0, nodes=2)
    )
    assert [(p.started_by, p.queue) for p in here.trainer_nodes] == [
        ("rollflow", None),
        ("you", None),
    ]


def test_a_node_deployment_the_api_does_not_hold_is_said_before_anything_starts(prefect_pools):
    """``RunServices.start`` checks it first; the error names the key and what to do."""
    prefect_pools({"default": {}})
    placed = nodes.TrainerNodes("rollflow-trainer-node/gpu", [], progress=lambda _: None)
    with pytest.raises(
        ServiceError, match=r"trainer.node_deployment = 'rollflow-trainer-node/gpu'"
    ):
        placed.check()


def test_a_node_still_running_after_node_0_stopped_is_cancelled_and_a_failed_one_said(monkeypatch):
    said, cancelled = [], []
    placed = nodes.TrainerNodes("rollflow-trainer-node/default", [], progress=said.append)
    placed.flow_runs = {1: "id-1", 2: "id-2"}
    monkeypatch.setattr(placed, "states", lambda: {1: "RUNNING", 2: "FAILED"})
    monkeypatch.setattr(placed, "_cancel", cancelled.append)
    assert placed.end(grace_s=0.0) == {1: "RUNNING", 2: "FAILED"}
    assert cancelled == [[1]]
    assert any("node 2's flow run (id-2) ended FAILED" in line for line in said)
    monkeypatch.setattr(placed, "states", lambda: {1: "COMPLETED", 2: "COMPLETED"})
    cancelled.clear()
    assert placed.end(grace_s=5.0) == {1: "COMPLETED", 2: "COMPLETED"} and cancelled == []


def test_a_restart_cancels_the_running_nodes_and_waits_for_their_end(monkeypatch):
    """Node 0 was lost: the other nodes' flow runs are cancelled and waited for (their ranks
    must leave the rendezvous before new ones join); one that does not end is named."""
    placed = nodes.TrainerNodes("rollflow-trainer-node/default", [], progress=lambda _: None)
    placed.flow_runs = {1: "id-1", 2: "id-2"}
    states = {1: "RUNNING", 2: "FAILED"}
    cancelled = []

    def cancel(which):
        cancelled.append(which)
        states.update(dict.fromkeys(which, "CANCELLED"))

    monkeypatch.setattr(placed, "states", lambda: dict(states))
    monkeypatch.setattr(placed, "_cancel", cancel)
    assert placed.stop(timeout_s=5.0) == {1: "CANCELLED", 2: "FAILED"} and cancelled == [[1]]

    states[1] = "RUNNING"
    monkeypatch.setattr(placed, "_cancel", lambda which: None)  # its worker never stops it
    with pytest.raises(ServiceError, match=r"node\(s\) \[1\] still \['RUNNING'\] 0s after"):
        placed.stop(timeout_s=0.0)


def test_a_node_whose_flow_run_ended_while_the_run_goes_on_is_a_lost_trainer(monkeypatch):
    said = []
    placed = nodes.TrainerNodes("rollflow-trainer-node/default", [], progress=said.append)
    placed.flow_runs = {1: "id-1"}
    monkeypatch.setattr(placed, "states", lambda: {1: "RUNNING"})
    placed.check_running()
    monkeypatch.setattr(placed, "states", lambda: {1: "FAILED"})
    with pytest.raises(ServiceError, match=r"trainer node 1's flow run \(id-1\) ended FAILED"):
        placed.check_running()

    def api_down():
        raise OSError("connection refused")

    monkeypatch.setattr(placed, "states", api_down)
    placed.check_running()  # the API's hiccup is no node's death
    assert any("could not read the nodes' flow runs" in line for line in said)


class _Api(FakeFlowRuns):
    """The submitted nodes' flow runs, their waits cut short."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        sleep = time.sleep  # (the module's: patched for every caller while the test runs)
        monkeypatch.setattr(nodes.time, "sleep", lambda s: sleep(min(s, 0.02)))


def _node_0(tmp_path, startup_timeout_s: float = 5.0):
    from rollflow.infra.storage import RunStorage
    from rollflow.services.trainer_life import trainer_args

    cfg = _cfg(
        "trainer.num_nodes=2",
        "trainer.master_addr=auto",
        "trainer.node_deployment='rollflow-trainer-node/gpu'",
        "trainer.node_queues=['host-1', 'host-0']",
        f"trainer.startup_timeout_s={startup_timeout_s}",
    )
    storage = RunStorage(str(tmp_path / "runs"), "run")
    placed = nodes.TrainerNodes(
        cfg.trainer.node_deployment, cfg.trainer.node_queues, lambda _: None
    )
    trainer = nodes.PlacedTrainer(
        placed,
        "run",
        trainer_args(cfg, "/m", None),
        "key",
        storage,
        {"storage": (storage.root, {}), "reach": "192.0.2.9", "gpus": [0, 1], "cpus": []},
        progress=lambda _: None,
    )
    trainer.startup_timeout_s = startup_timeout_s  # no placement allowance in a unit test
    return trainer, storage


def test_node_0_as_a_flow_run_is_met_where_its_own_flow_run_says_it_serves(tmp_path, monkeypatch):
    """``PlacedTrainer``: node 0 submitted to its queue (its settings, never the key, in the
    parameters), then met at the URL and address its own flow run wrote (an earlier flow run's
    record is not its own); stopped: shut down over its API, cancelled when it does not end."""
    api = _Api(monkeypatch)
    trainer, storage = _node_0(tmp_path)
    trainer.start()
    [asked] = api.submitted
    assert (asked["node"], asked["queue"], asked["gpus"]) == (0, "host-1", [0, 1])
    assert asked["serve"]["reach"] == "192.0.2.9" and "key" not in str(asked)
    args = json.loads(asked["args"])
    assert args["trainer"]["master_addr"] == "auto"  # node 0's flow run finds its address
    api.states[trainer.flow_run_id] = "RUNNING"
    storage.write_json(
        toolkit.NODE_0_FILE, {"flow_run_id": "earlier", "url": "http://x:1", "master_addr": "x"}
    )
    threading.Timer(
        0.2,
        storage.write_json,
        (
            toolkit.NODE_0_FILE,
            {
                "flow_run_id": str(trainer.flow_run_id),
                "url": "http://192.0.2.7:4242/",
                "master_addr": "192.0.2.7",
            },
        ),
    ).start()
    assert trainer.wait_placed() == "192.0.2.7"
    assert trainer.client.url == "http://192.0.2.7:4242" and trainer.is_alive()

    shut = []
    monkeypatch.setattr(trainer.client, "shutdown", lambda timeout_s: shut.append(timeout_s))
    trainer.stop(timeout_s=0.5)  # asked to shut down; its flow run never ended: cancelled
    assert shut and api.cancelled == [trainer.flow_run_id] and not trainer.is_alive()


def test_node_0_no_worker_takes_or_that_ends_first_fails_the_start_naming_it(tmp_path, monkeypatch):
    api = _Api(monkeypatch)
    trainer, _ = _node_0(tmp_path, startup_timeout_s=0.1)
    trainer.start()
    with pytest.raises(
        ServiceError,
        match=r"was SCHEDULED .* start a worker of "
        r"rollflow-trainer-node/gpu's pool \(work queue 'host-1'\) on node 0's host",
    ):
        trainer.wait_placed()
    trainer.start()
    api.states[trainer.flow_run_id] = "FAILED"
    with pytest.raises(
        ServiceError, match="trainer node 0's flow run ended FAILED before it served"
    ):
        trainer.wait_placed()
    with pytest.raises(ServiceError, match=r"node 0's flow run \(.*\) ended FAILED; see the log"):
        trainer.check_alive()


def test_node_0_started_by_hand_without_the_runs_key_refuses(tmp_path):
    """The flow body reads the trainer's key from the run's storage, not a UI-visible parameter."""
    from rollflow.services.trainer_life import trainer_args

    cfg = _cfg("trainer.master_addr=auto", "trainer.node_deployment='rollflow-trainer-node/gpu'")
    serve = {"storage": str(tmp_path / "runs"), "storage_options": {}, "reach": "127.0.0.1"}
    args = trainer_args(cfg, "/m", None).model_dump_json()
    with pytest.raises(ServiceError, match=r"control/servers/key.json holds no key"):
        trainer_node._serve_node_0("run", args, [], serve, "id", toolkit.DriverWatch(None))


def _deepspeed_args(num_ranks: int) -> str:
    from rollflow.infra.config import TrainerServiceSection
    from rollflow.trainer.protocol import ServiceArgs

    trainer = TrainerServiceSection(
        backend="deepspeed", num_ranks=num_ranks, num_nodes=2, master_addr="n0", device="cuda"
    )
    return ServiceArgs(
        model_path="/m", storage_root="s3://b", run="run", trainer=trainer
    ).model_dump_json()


def test_a_placed_node_names_its_own_hosts_gpus_never_the_run_hosts(
    flow_logger, monkeypatch, tmp_path
):
    """Node 1's flow run on a worker given GPUs 6,7 (its host's CUDA_VISIBLE_DEVICES) puts its
    rank on 6, its host's first, in the variable and in DeepSpeed's command (its launcher sets
    the ranks' variable to the ids named); node 0's on a worker given 4-7, on 4 and 5. A host
    with none fails the flow run naming its list, before anything starts."""
    import base64

    from rollflow.infra.placement import PlanError
    from rollflow.services import trainer_process

    in_a_placed_flow_run(monkeypatch, trainer_node)
    started = []
    monkeypatch.setattr(
        trainer_node, "_run_node", lambda run, node, argv, env, watch: started.append((argv, env))
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    trainer_node.trainer_node.fn("run", 1, _deepspeed_args(1), [0])
    [(argv, env)] = started
    assert env == {"CUDA_VISIBLE_DEVICES": "6"}
    [world] = [a.split("=", 1)[1] for a in argv if a.startswith("--world_info=")]
    assert json.loads(base64.urlsafe_b64decode(world)) == {"node-0": [0], "node-1": [6]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES=''"):
        trainer_node.trainer_node.fn("run", 1, _deepspeed_args(1), [0])

    class Made(Exception):
        pass

    def made(args, **kwargs):
        raise Made(kwargs["device_env"])

    monkeypatch.setattr(trainer_process, "TrainerProcess", made)
    storage = RunStorage(str(tmp_path / "runs"), "run")
    toolkit.publish_key(storage, "k")
    serve = {"storage": storage.root, "storage_options": {}, "reach": "127.0.0.1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with pytest.raises(Made) as node_0:
        trainer_node._serve_node_0(
            "run", _deepspeed_args(2), [0, 1], serve, "id", toolkit.DriverWatch(None)
        )
    assert node_0.value.args[0] == {"CUDA_VISIBLE_DEVICES": "4,5"}


def test_a_prefect_api_hiccup_is_no_death_of_a_placed_node_0_or_server(tmp_path, monkeypatch):
    """The run's health check asks every 5 s whether node 0 (and each placed server) lives: a
    Prefect API that does not answer once leaves the last state read, it does not fail the run."""
    from rollflow.services import placed_server as servers

    api = _Api(monkeypatch)
    trainer, _ = _node_0(tmp_path)
    trainer.start()
    api.states[trainer.flow_run_id] = "RUNNING"
    assert trainer.is_alive()
    server = servers.PlacedServer(
        "rollflow-inference-server/default",
        "",
        "run",
        0,
        (str(tmp_path), {}),
        ("policy", 0),
        {"reach": "127.0.0.1", "startup_timeout_s": 1},
        api_key="k",
        progress=lambda _: None,
    )
    server.flow_run_id = uuid.uuid4()
    monkeypatch.setattr(toolkit, "flow_run_state", lambda fid: "RUNNING")
    assert server.is_alive()

    def down(flow_run_id):
        raise OSError("connection refused")

    monkeypatch.setattr(toolkit, "flow_run_state", down)
    assert trainer.is_alive() and trainer.state() == "RUNNING"
    assert server.state(fresh=True) == "RUNNING" and server.is_alive()


def test_every_nodes_flow_run_loads_the_runs_storage_secret_itself(
    flow_logger, monkeypatch, tmp_path
):
    """``run.storage_secret`` with placed nodes: each node's flow run gets the Secret block's
    name (never its value) and loads it on its own host, where its ranks inherit it (before,
    the run handed it to its own processes only, and a node on another host met its storage
    without the credentials the run was given)."""
    api = _Api(monkeypatch)
    root = str(tmp_path / "runs")
    placed = nodes.TrainerNodes("d/default", [], lambda _: None, storage_secret=(root, "creds"))
    placed.submit("r", "{}", {1: [], 2: []})
    assert [asked["storage_secret"] for asked in api.submitted] == [[root, "creds"]] * 2
    nodes.TrainerNodes("d/default", [], lambda _: None).submit("r", "{}", {1: []})
    assert "storage_secret" not in api.submitted[-1]

    # The flow body, on the node's host: the block loaded, handed to the launcher's processes.
    in_a_placed_flow_run(monkeypatch, trainer_node)
    rank = (
        "from rollflow.infra.storage import RunStorage; "
        f"print('rank sees', RunStorage({root!r}, 'r').options['secret'])"
    )
    from rollflow.services import trainer_process

    monkeypatch.setattr(
        trainer_process, "node_command", lambda args, node, gpus: ([sys.executable, "-c", rank], {})
    )
    out = trainer_node.trainer_node.fn("r", 1, "{}", [], storage_secret=[root, "creds"])
    assert out["exit_code"] == 0 and "rank sees planted-secret" in flow_logger, flow_logger
