"""The suite's own layout: pytest imports test modules by basename (no packages), so two test
files of one name in different tiers break collection of the whole suite."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1]


def test_files_that_share_a_session_service_are_one_work_unit_of_the_workers():
    """conftest.py's groups reach the scheduler: each test id carries its group (``@name``), so
    the deployed run (~150 s) is made on one worker, not once on each (it was, unseen, while
    pytest-xdist's own suffix did nothing under pytest 9.2)."""
    import subprocess
    import sys

    files = [
        "tests/integration/flows/test_deployment.py",
        "tests/integration/notebooks/test_rollouts_notebook.py",
        "tests/integration/trainer/test_lora_sync.py",
    ]
    planned = subprocess.run(
        # One worker: the ids the scheduler gets are the same, with one collection, not two.
        [sys.executable, "-m", "pytest", "--setup-plan", "-v", "-n", "1", "-p", "no:cacheprovider"]
        + files,
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
        timeout=120,
    )
    assert planned.returncode in (0, 5), planned.stdout[-3000:] + planned.stderr[-3000:]
    ids = [line.split()[0] for line in planned.stdout.splitlines() if "::" in line]
    assert len(ids) > 10, planned.stdout[-3000:]
    for test_id in ids:
        group = "vllm_server" if "test_lora_sync" in test_id else "deployed_run"
        assert test_id.endswith(f"@{group}"), test_id
