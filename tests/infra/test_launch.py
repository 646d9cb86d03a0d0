"""Naming the dead trainer rank from the launcher's log, when rank 0 could not say it itself."""

from rollflow.infra.launch import _failure_in_log

TORCHRUN_ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
rollflow.tasks.train.service FAILED
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
    log.write_text("trainer[0] ERROR trainer rank 1 (pid 42) died; see trainer.log\n" + TORCHRUN_ROOT_CAUSE)
    assert _failure_in_log(log) == "trainer rank 1 (pid 42) died"


def test_torchruns_root_cause_names_the_rank_when_rank_zero_died(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(TORCHRUN_ROOT_CAUSE)
    assert _failure_in_log(log) == "trainer rank 1 (pid 29834) died (exit code -9)"


def test_no_failure_recorded(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text("trainer[0] INFO rank 0/1 ready\n")
    assert _failure_in_log(log) is None
    assert _failure_in_log(tmp_path / "missing.log") is None
