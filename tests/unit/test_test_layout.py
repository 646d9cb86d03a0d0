"""The suite's own layout: pytest imports test modules by basename (no packages), so two test
files of one name in different tiers break collection of the whole suite."""

import ipaddress
import re
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


def test_each_worker_has_a_prefect_home_of_its_own():
    """conftest.py gives each xdist worker its own PREFECT_HOME (its SQLite database): the
    workers inherit the controller's environment, where one was already set (`main`), and
    every worker used that one."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    assert Path(os.environ["PREFECT_HOME"]).name == worker


def test_a_process_that_outlives_the_suite_is_named_and_killed(tmp_path):
    """A test that leaves a process behind: once the suite is over, its pytest names it and
    kills it (conftest.py's pytest_sessionfinish), and no other process of the caller's."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    import psutil

    (tmp_path / "tests").mkdir()
    for helper in ("conftest.py", "deployed_run.py"):
        shutil.copy(TESTS / helper, tmp_path / "tests" / helper)
    (tmp_path / "tests" / "test_leak.py").write_text(
        "import subprocess, sys\n"
        "def test_leaves_a_process():\n"
        "    proc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],\n"
        "                            start_new_session=True)\n"
        "    print('left', proc.pid)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "tests/test_leak.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [pid] = [int(line.split()[-1]) for line in done.stdout.splitlines() if "left " in line]
    assert "1 process(es) outlived the suite, now killed:" in done.stdout, done.stdout[-3000:]
    assert f"pid {pid}: " in done.stdout

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the process left by the test (pid {pid}) still runs"


# docs/reference/tests.md, "No test connects to an address outside what it made".
IPV4 = re.compile(r"(?<![\d.])\d{1,3}(?:\.\d{1,3}){3}(?!\.?\d)")
DOCUMENTATION = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")  # RFC 5737: no host's
NOT_CONNECTED = "# not connected to"


def test_no_test_names_an_address_outside_what_it_made():
    """Every literal IPv4 address in the tests is loopback, the two hosts' link
    (host_support.SUBNET), a documentation address (a stand-in value, RFC 5737), or on a line
    marked ``# not connected to``. The rule came from test_hosts.py, which connected to an
    address past the hosts' link to show that host 1 reached nothing there."""
    from host_support import SUBNET

    allowed = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", *DOCUMENTATION)]
    allowed.append(ipaddress.ip_network(SUBNET.format(0), strict=False))
    found = []
    for path in sorted(TESTS.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for literal in IPV4.findall(line):
                try:
                    address = ipaddress.ip_address(literal)
                except ValueError:  # not an address (an octet over 255)
                    continue
                if not any(address in net for net in allowed) and not line.endswith(NOT_CONNECTED):
                    found.append(f"{path.relative_to(TESTS.parent)}:{number}: {literal}")
    assert not found, "addresses outside what the tests make:\n" + "\n".join(found)
