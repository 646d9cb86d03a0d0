"""Shared by the end-to-end run tests: a small config, the CLI in a subprocess, the layout check,
and one Prefect API for every whole run of the session."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# S3 credentials a test gives a run, then looks for in everything the run stores.
PLANTED_KEY = "AKIAPLANTEDKEY000001"
PLANTED_SECRET = "planted-secret-value-7f3a9c"
SMALL = """
[run]
name = "{name}"
storage = "{storage}"
num_steps = {steps}
eval_every = 2

[model]
warm_start_target = 0.3
warm_start_max_steps = 50
cache_dir = "{cache}"

[model.tiny]
hidden_size = 64
num_heads = 2
intermediate_size = 128

[[envs]]
name = "sort_letters"

[[envs]]
name = "add"
args = {{ max_value = 9 }}

[sampling]
group_size = 4
max_tokens = 6
num_eval_prompts = 16

[train]
lr = 1e-4
train_batch_size = 8
mini_batch_size = 4
"""


def write_config(
    tmp_path: Path, cache: Path, name: str = "small", steps: int = 4, storage: str | None = None
) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        SMALL.format(name=name, storage=storage or tmp_path / "runs", steps=steps, cache=cache)
    )
    return path


# The session's Prefect API: rollflow's own private API (``local_prefect_api``), held open by a
# small process of its own until the session ends. A run given PREFECT_API_URL uses it instead of
# starting one (a start, with its database's migration, took 20-60 s on 2 busy cores).
_API_HOLDER = """
import sys
from rollflow.infra.prefect_api import local_prefect_api
with local_prefect_api() as url:
    print(url, flush=True)
    sys.stdin.read()
"""
_api: subprocess.Popen | None = None
_api_url: str | None = None
_api_home: Path | None = None  # its Prefect home (~12 MB), removed with it


def session_prefect_api() -> str:
    """The URL of the session's Prefect API, started on first use and stopped at exit."""
    global _api, _api_url, _api_home
    if _api_url is None:
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        _api_home = Path(tempfile.mkdtemp(prefix="rollflow-tests-prefect-"))
        home = seeded_prefect_home(_api_home)
        env["PREFECT_HOME"] = str(home)
        _api = subprocess.Popen(
            [sys.executable, "-c", _API_HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        atexit.register(stop_session_api)
        url = _api.stdout.readline().strip()
        assert url.startswith("http"), f"the session's Prefect API did not start ({url!r})"
        _api_url = url
    return _api_url


def seeded_prefect_home(home: Path) -> Path:
    """``home``, holding a copy of a Prefect database that a Prefect API has started on once (its
    migrations and first-start registrations done), for a server the test starts there: it is
    healthy in ~5 s instead of ~11 s (quiet; ~7 s of CPU saved, each of the suite's ~8 servers).
    The copy is made once per checkout and Prefect version, under a lock the workers share."""
    import fcntl
    import shutil

    import prefect

    template = ROOT / ".prefect" / f"template-{prefect.__version__}"
    template.mkdir(parents=True, exist_ok=True)
    with open(template / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (template / "ready").exists():
            api = RestartableApi(template / "home")
            api.start()
            api.stop()
            for name in ("prefect.db", "prefect.db-wal"):  # (the WAL, if any, goes with it)
                if (template / "home" / name).exists():
                    shutil.copy(template / "home" / name, template / name)
            (template / "ready").touch()
    home.mkdir(parents=True, exist_ok=True)
    for name in ("prefect.db", "prefect.db-wal"):
        if (template / name).exists() and not (home / name).exists():
            shutil.copy(template / name, home / name)
    return home


def stop_session_api() -> None:
    """Stop the session's Prefect API and remove its home (every suite left one in /tmp)."""
    global _api_home
    if _api is not None and _api.poll() is None:
        _api.stdin.close()  # the holder leaves local_prefect_api's block: the API stops
        try:
            _api.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _api.kill()
            _api.wait(timeout=10)
    if _api_home is not None:
        shutil.rmtree(_api_home, ignore_errors=True)
        _api_home = None


def env_for(tmp_path: Path, api: bool = True) -> dict[str, str]:
    """A run's environment: its own PREFECT_HOME, and the session's Prefect API unless ``api`` is
    false (then the run starts its own private one, as without a configured server)."""
    home = tmp_path / "prefect"
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    if api:
        env["PREFECT_API_URL"] = session_prefect_api()
    else:
        seeded_prefect_home(home)  # (its own API's database, migrated already)
        env.pop("PREFECT_API_URL", None)
    return env


def run_cli(config: Path, tmp_path: Path, *overrides: str, timeout: float = 420) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_for(tmp_path),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def assert_every_step_once(run_dir: Path, steps: int) -> None:
    import duckdb

    for kind in ("rollouts", "batches", "checkpoints"):
        found = sorted(p.name for p in (run_dir / kind).iterdir())
        assert found == sorted(f"step={s}" for s in range(1, steps + 1)), (kind, found)
        for s in range(1, steps + 1):
            assert (run_dir / kind / f"step={s}" / "_SUCCESS").exists()
    rows = duckdb.sql(
        f"select step, count(*) n, count(distinct group_index) g from "
        f"read_parquet('{run_dir}/rollouts/*/*.parquet', hive_partitioning=true) group by step order by step"
    ).fetchall()
    assert rows == [(s, 32, 8) for s in range(1, steps + 1)]


def assert_documented_layout(
    run_dir: Path,
    out: str,
    tmp_path: Path,
    rerun_args: list[str],
    *,
    storage: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """A finished 4-step synchronous run of ``SMALL`` (eval every 2 steps) wrote the documented
    layout; `rollflow status` tables it; rerunning it (``rerun_args`` after ``rollflow run``)
    does nothing and says so.

    ``run_dir`` is the run's folder, or a local copy of it where the run's ``storage`` is object
    storage (its events are then read there: an object store holds them in segments); ``env``
    is the environment of `rollflow status` and of the rerun (default ``env_for(tmp_path)``)."""
    import duckdb
    import pandas as pd

    from rollflow.infra.storage import RunStorage

    env = env or env_for(tmp_path)
    storage = storage or str(run_dir.parent)

    assert "step 4/4" in out and "held-out reward" in out
    assert_every_step_once(run_dir, 4)
    df = pd.read_parquet(run_dir / "rollouts", partitioning=None)  # step is a column of every file
    expected = {
        "run",
        "step",
        "env",
        "prompt_id",
        "group_index",
        "sample_index",
        "prompt_ids",
        "completion_ids",
        "completion_logprobs",
        "reward",
        "advantage",
        "version_started",
        "version_finished",
        "finish_reason",
        "error",
        "info",
    }
    assert expected <= set(df.columns)
    # Synchronous RL: step N was sampled by the policy of version N-1.
    assert (df["version_started"] == df["step"] - 1).all()
    assert all(
        len(ids) == len(lp)
        for ids, lp in zip(df["completion_ids"], df["completion_logprobs"], strict=True)
    )
    batches = duckdb.sql(
        f"select advantage from read_parquet('{run_dir}/batches/*/*.parquet')"
    ).df()
    assert batches["advantage"].notna().all()
    events = [e["event"] for e in RunStorage(storage, run_dir.name).read_events()]
    assert events.count("step_committed") == 4 and events[-1] == "training_finished"
    metrics = duckdb.sql(
        f"select * from read_parquet('{run_dir}/metrics/*.parquet', union_by_name=true)"
    ).df()
    assert sorted(metrics["step"]) == [0, 1, 2, 3, 4]
    assert metrics["eval_reward"].notna().sum() == 3  # steps 0, 2, 4
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow.cli",
            "status",
            run_dir.name,
            "--storage",
            storage,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[5].split()[0] == "4"  # header, steps 0..4
    assert "4 steps committed (last: 4), training finished" in status.stdout
    # A rerun of a finished run does nothing and says so.
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", *rerun_args],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "already committed" in proc.stdout


class RestartableApi:
    """A Prefect API that a test stops and starts again under a run, on the same port and the
    same database: rollflow's private API (``local_prefect_api``'s app), run by the test."""

    def __init__(self, home: Path) -> None:
        from rollflow.infra.processes import free_port

        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> None:
        import time

        import httpx
        from prefect.settings import get_current_settings

        from rollflow.infra.prefect_api import private_api_command, private_api_env

        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(private_api_env(get_current_settings()), PREFECT_HOME=str(self.home))
        env.pop("PREFECT_API_URL", None)
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "api.log", "ab")  # noqa: SIM115 (the server's, while it runs)
        self.proc = subprocess.Popen(
            private_api_command(self.port), stdout=log, stderr=log, env=env, cwd=ROOT
        )
        end = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.home / "api.log").read_text()[-3000:]
            assert time.monotonic() < end, "the Prefect API did not start"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def post(self, path: str, body: dict | None = None) -> list[dict]:
        import httpx

        response = httpx.post(f"{self.url}{path}", json=body or {}, timeout=30)
        response.raise_for_status()
        return response.json()


def run_cli_watched(
    config: Path,
    tmp_path: Path,
    *overrides: str,
    on_line=lambda line: None,
    env: dict[str, str] | None = None,
    timeout: float = 420,
) -> tuple[int, str, str]:
    """``rollflow run`` in a subprocess, ``on_line`` called with each line of its stdout as it
    comes (to act on the run mid-way); returns its exit status, stdout and stderr."""
    import threading

    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflow.cli", "run", str(config), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or env_for(tmp_path),
        cwd=ROOT,
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            out.append(line)
            on_line(line)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    return proc.returncode, "".join(out), "".join(err)
