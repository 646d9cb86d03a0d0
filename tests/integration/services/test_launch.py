"""Naming the dead trainer rank from the launcher's log, when rank 0 could not say it itself, or
from its exit, when one rank ran without a launcher;
how the ranks share a host's cores with vLLM; a trainer whose HTTP port is taken fails its start
at once; service ports come from outside the kernel's ephemeral range."""

import os
import socket
import sys
import time

import pytest

from rollflow.infra.config import TrainerServiceSection
from rollflow.infra.errors import ServiceError
from rollflow.infra.processes import _ephemeral_low, cpu_split, free_port
from rollflow.services.trainer_process import TrainerProcess, _failure_in_log
from rollflow.trainer.protocol import ServiceArgs

TORCHRUN_ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
rollflow.trainer.rank_main FAILED
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_09:42:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 29834)  (SIGKILL)
  error_file: <N/A>
"""


def test_rank_zeros_own_report_wins(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(
        "trainer[0] ERROR trainer rank 1 (pid 42) died; see trainer.log\n" + TORCHRUN_ROOT_CAUSE
    )
    assert _failure_in_log(log) == "trainer rank 1 (pid 42) died"


def test_torchruns_root_cause_names_the_rank_when_rank_zero_died(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(TORCHRUN_ROOT_CAUSE)
    assert _failure_in_log(log) == "trainer rank 1 (pid 29834) died (exit code -9)"


def test_a_rank_alone_killed_is_named_by_its_exit(tmp_path):
    """One FSDP2 rank runs without a launcher, so no root cause reaches the log: the guard's exit
    code (128 + 9) says it. The rank here kills itself at once, under the real guard."""
    args = ServiceArgs(
        model_path="m", storage_root="runs", run="t", trainer=TrainerServiceSection(device="cpu")
    )
    proc = TrainerProcess(args, token="t", log_dir=tmp_path)
    assert proc.direct and "torch.distributed.run" not in proc.process.argv
    proc.process.argv = [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]
    proc.process.start()
    proc.process.proc.wait(timeout=30)
    with pytest.raises(ServiceError) as err:
        proc.check_alive()
    assert "the trainer has exited (code 137): trainer rank 0 died (killed by SIGKILL)" in str(
        err.value
    )


def test_no_failure_recorded(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text("trainer[0] INFO rank 0/1 ready\n")
    assert _failure_in_log(log) is None
    assert _failure_in_log(tmp_path / "missing.log") is None


@pytest.mark.parametrize(
    ("cpus", "inference", "trainer"),
    [({0, 1}, [0], [1]), ({0}, [0], [0]), (set(range(8)), [0, 1, 2, 3], [4, 5, 6, 7])],
)
def test_cpu_split_gives_vllm_and_the_trainer_their_own_cores(
    monkeypatch, cpus, inference, trainer
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    assert cpu_split() == (inference, trainer)


def test_ranks_beside_vllm_on_a_cpu_host_keep_to_the_trainers_cores(monkeypatch, tmp_path):
    monkeypatch.delenv("ROLLFLOW_TRAINER_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def threads(num_ranks: int, beside_inference: bool = False) -> str:
        args = ServiceArgs(
            model_path="m",
            storage_root="runs",
            run="t",
            trainer=TrainerServiceSection(device="cpu", num_ranks=num_ranks),
        )
        proc = TrainerProcess(args, token="t", log_dir=tmp_path, beside_inference=beside_inference)
        return proc.process.env["OMP_NUM_THREADS"]

    assert threads(num_ranks=1) == "8"  # alone: every core
    assert threads(num_ranks=1, beside_inference=True) == "4"  # beside vLLM: its half
    assert threads(num_ranks=2, beside_inference=True) == "2"
    monkeypatch.setenv("ROLLFLOW_TRAINER_THREADS", "3")  # the user's choice wins
    assert threads(num_ranks=1, beside_inference=True) == "3"


def test_service_ports_are_free_and_below_the_ephemeral_range():
    # Outgoing connections take their source ports from the ephemeral range: a service port
    # picked there can be taken before the service binds it (the multi-turn run lost its
    # trainer's port so, in a full suite run).
    low = _ephemeral_low()
    if low < 11_000:
        pytest.skip(f"the ephemeral range starts at {low}: free_port falls back to bind(0)")
    ports = [free_port() for _ in range(20)]
    assert all(10_000 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 10  # random, not one sequence every process repeats
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


@pytest.mark.slow
def test_a_taken_http_port_fails_the_trainers_start_at_once_naming_it(tiny_model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ServiceArgs(
            model_path=str(tiny_model_dir),
            storage_root=str(tmp_path / "runs"),
            run="t",
            port=port,
            trainer=TrainerServiceSection(device="cpu", num_ranks=1, startup_timeout_s=600),
        )
        proc = TrainerProcess(args, token="t", log_dir=tmp_path / "logs")
        start = time.monotonic()
        proc.start()
        try:
            with pytest.raises(ServiceError, match="before becoming healthy") as err:
                proc.wait_healthy()
        finally:
            proc.stop(timeout_s=10)
    # Not the 600 s deadline: rank 0 exits once its HTTP server cannot bind.
    assert time.monotonic() - start < 120
    assert "address already in use" in str(err.value)
    assert f"no HTTP server on 127.0.0.1:{port}" in str(err.value)
