"""Trainer nodes 1.. as flow runs (flows/nodes.py): the node's flow body, the log it forwards,
and the config that places them. The whole path (a run submitting node 1 to a worker on another
host, through a real Prefect server) is tests/integration/flows/test_scale_out.py's two-node run."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from rollflow.flows import nodes
from rollflow.infra.config import load_config
from rollflow.infra.errors import ConfigError, ServiceError


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
    nodes.follow_log(log, alive.is_set, lines.append, interval_s=0.05)
    writer.join()
    assert lines == ["rank 0: waiting for the rendezvous", "rank 0: half a line", "rank 0: ended"]


@pytest.fixture
def flow_logger(monkeypatch):
    """The flow body outside a flow run: the lines it says, kept."""
    kept: list[str] = []
    monkeypatch.setattr(nodes, "say", kept.append)
    return kept


def test_a_node_runs_to_its_end_and_its_lines_reach_the_flow_runs_log(flow_logger):
    code = "import os; print('node', os.environ['NODE_ENV'])"
    out = nodes._run_node("r", 1, [sys.executable, "-c", code], {"NODE_ENV": "given"})
    assert out == {"run": "r", "node": 1, "exit_code": 0}
    assert "node given" in flow_logger


def test_a_node_that_fails_fails_its_flow_run_naming_the_node_and_its_last_lines(flow_logger):
    code = "import sys; print('rendezvous timed out'); sys.exit(3)"
    with pytest.raises(ServiceError, match=r"trainer node 1 of run r exited with code 3") as err:
        nodes._run_node("r", 1, [sys.executable, "-c", code])
    assert "rendezvous timed out" in str(err.value) and "rendezvous timed out" in flow_logger


def _cfg(*overrides: str):
    return load_config(None, ["model.path='/m'", "envs=[{name='sort_letters'}]", *overrides])


def test_node_queues_name_one_queue_per_node_of_the_nodes_deployment():
    placed = _cfg(
        "trainer.num_nodes=3",
        "trainer.node_deployment='rollflow-trainer-node/default'",
        "trainer.node_queues=['host-1', 'host-2']",
    )
    assert placed.trainer.node_queues == ["host-1", "host-2"]
    with pytest.raises(ConfigError, match=r"names 1 queue\(s\) for 2 node\(s\) after node 0"):
        _cfg(
            "trainer.num_nodes=3",
            "trainer.node_deployment='rollflow-trainer-node/default'",
            "trainer.node_queues=['host-1']",
        )
    with pytest.raises(ConfigError, match="trainer.node_deployment is empty"):
        _cfg("trainer.num_nodes=2", "trainer.node_queues=['host-1']")


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
