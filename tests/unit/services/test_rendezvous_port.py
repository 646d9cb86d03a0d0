"""Node 0 of a multi-node trainer starts its launcher only once its rendezvous port is free: a
restarted trainer's node 0 on the host where the lost one is still exiting (seen in CI's two-host
run: "address already in use" on ``trainer.master_port``, the run failed)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rollflow.infra.config import TrainerServiceSection, TrainSection
from rollflow.infra.errors import ServiceError
from rollflow.infra.processes import free_port
from rollflow.services import trainer_process as launch
from rollflow.services.trainer_process import TrainerProcess
from rollflow.trainer.protocol import ServiceArgs


def node_0(tmp_path, port: int, said: list[str]) -> tuple[TrainerProcess, list[float]]:
    """Node 0 of two, its launcher's start recorded (when) instead of run."""
    args = ServiceArgs(
        model_path="m",
        storage_root=str(tmp_path),
        run="r",
        train=TrainSection(),
        trainer=TrainerServiceSection(
            num_ranks=1, num_nodes=2, master_addr="127.0.0.1", master_port=port
        ),
    )
    proc = TrainerProcess(args, token="t", log_dir=tmp_path, progress=said.append)
    started: list[float] = []
    proc.process.start = lambda: started.append(time.monotonic())
    return proc, started


def listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_node_0_waits_for_its_rendezvous_port_then_starts(tmp_path):
    port, said = free_port(), []
    proc, started = node_0(tmp_path, port, said)
    held = listener(port)  # the lost trainer's launcher, still exiting
    starting = threading.Thread(target=proc.start)
    starting.start()
    time.sleep(1.5)
    assert not started, "the launcher started while its rendezvous port was held"
    released = time.monotonic()
    held.close()
    starting.join(timeout=10)
    assert not starting.is_alive() and started and started[0] >= released
    assert len(said) == 1 and f"port {port} is still held on this host" in said[0], said


def test_a_port_held_for_good_is_an_error_naming_its_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "RENDEZVOUS_FREE_TIMEOUT_S", 1.0)
    port, said = free_port(), []
    proc, started = node_0(tmp_path, port, said)
    with listener(port):
        with pytest.raises(ServiceError, match=rf"trainer.master_port\): port {port} .* by pid"):
            proc.start()
    assert not started


def test_a_free_port_starts_at_once_and_says_nothing(tmp_path):
    said: list[str] = []
    proc, started = node_0(tmp_path, free_port(), said)
    proc.start()
    assert started and not said
