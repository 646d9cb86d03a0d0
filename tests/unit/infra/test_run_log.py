"""The run's log set-up survives the run flow's imports (infra/terminal.py, ``attach_run_log``):
`rollflow run` imports those modules after attaching the log, while its private API starts. What
undid the set-up is their ``from prefect import flow`` (it loads ``prefect.main``), so the check
imports that alone: ~3 s, not the ~18 s of the whole run flow on the suite's busy cores."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter: Prefect applies its logging config once, when prefect.main loads.
CHECK = """
import logging, sys
from pathlib import Path
from rollflow.infra import terminal
terminal.attach_run_log(Path(sys.argv[1]), debug=False)
from prefect import flow  # as the run flow's modules do: loads prefect.main
internal = logging.getLogger("prefect._internal").handlers
print([type(h).__name__ for h in internal], logging.getLogger("prefect").getEffectiveLevel())
"""


def test_prefect_workers_failures_stay_in_the_run_log_after_the_run_flow_is_imported(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")[-2]
    # EventsWorker's "failed to process item Event(...)" go to run.log, not the terminal's
    # stream handler; Prefect's INFO records reach run.log.
    assert out == "['FileHandler'] 20", out
