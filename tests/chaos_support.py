"""The fault campaign of tests/integration/flows/test_chaos_*.py: one run directory killed again
and again, its launches, kill points and storage checks.

The campaign is two files, each with a run directory of its own, so that the two halves run on
the suite's two workers side by side (tests/conftest.py): test_chaos_run.py (the run SIGKILLed,
stopped by Ctrl-C and SIGTERM, its vLLM killed) and test_chaos_trainer.py (its trainer killed,
then the rerun that completes the run). The seed (``ROLLFLOW_CHAOS_SEED``) and every kill point
are printed; each file also passes one test at a time, from an empty run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from deployed_run import flow_run_log, prefect_api, processes_marked
from run_support import ROOT, env_for, session_prefect_api, write_config

SEED = int(os.environ.get("ROLLFLOW_CHAOS_SEED", "6"))
STEPS = 14  # room for every fault's steps before the last launch completes the run
ROWS_PER_STEP = 8 * 4  # train_batch_size x group_size of run_support.SMALL
START_TIMEOUT_S = 300.0  # a launch's first step: Prefect API, vLLM start-up (slow on busy CI)


class Campaign:
    """One run directory killed again and again; launches, kill points and checks."""

    def __init__(self, root: Path, model_cache: Path, name: str, steps: int = STEPS):
        self.root, self.prefect_api, self.name = root, session_prefect_api(), name
        self.steps = steps
        self.config = write_config(root, model_cache, name=name, steps=steps)
        self.run_dir = root / "runs" / name
        self.rng = random.Random(SEED)
        self.launches = 0
        self.proc: subprocess.Popen | None = None
        # The events file is append-only: read once, then only the bytes added since (a wait
        # checks it every 10 ms, through the whole run).
        self._events: list[dict] = []
        self._events_read = 0
        print(f"\nchaos seed {SEED} (set ROLLFLOW_CHAOS_SEED to replay or vary)")

    # ------------------------------------------------------------------ launches

    def launch(
        self, *overrides: str, private_api: bool = False, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start the run; on the session's Prefect API unless ``private_api`` (the run starts
        its own, as without a configured server)."""
        if self.proc is not None and self.proc.poll() is None:  # an earlier test failed mid-launch
            self.kill_run(self.proc)
        self.launches += 1
        self.launched_at, self.overrides = time.time(), overrides
        self.log = self.root / f"launch-{self.launches}.log"
        env = {**env_for(self.root, api=not private_api), **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollflow.cli", "run", str(self.config), *overrides],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    def kill_at_random_point(self, step: int, *overrides: str, private_api: bool = False) -> str:
        """Launch, SIGKILL the run at a random moment of ``step``, check; returns what happened."""
        before = self.committed()
        proc = self.launch(*overrides, private_api=private_api)
        name, reached, delay = self.random_kill_point(step)
        self.wait_for(proc, reached, name)
        time.sleep(delay)
        self.kill_run(proc)
        self.assert_consistent()
        return f"{delay}s after {name}; committed {before[-1:]} -> {self.committed()[-1:]}"

    def stop_at_random_point(self, proc: subprocess.Popen, step: int, signum: int) -> str:
        """Send ``signum`` (SIGINT: Ctrl-C, or SIGTERM) to the launch ``proc`` at a seeded random
        moment of ``step``: the run stops within 30 s with exit code 128 + signum, leaves no
        process, and prints one line (no traceback, no error) saying what is committed and the
        command that resumes it (the launch's own, overrides included)."""
        name, reached, delay = self.random_kill_point(step)
        self.wait_for(proc, reached, name)
        time.sleep(delay)
        proc.send_signal(signum)
        sent = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        self.assert_no_orphans()
        self.assert_consistent()
        out = self.output()
        assert took < 30, out[-3000:]
        assert proc.returncode == 128 + signum, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert not [line for line in out.splitlines() if line.startswith("error")], out[-3000:]
        how = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        stopped = [line for line in out.splitlines() if line.startswith("stopped")]
        steps = self.committed()
        done = (
            f"committed through step {steps[-1]} of {self.steps} in {self.run_dir}"
            if steps
            else f"no step committed yet in {self.run_dir}"
        )
        # Steps that wrote their metrics but were stopped before their checkpoint (every step's
        # here: run.checkpoint_every's default, 1) are named as redone on resume.
        ran = [int(p.stem.split("=")[1]) for p in self.run_dir.glob("metrics/step=*.parquet")]
        after = sorted(s for s in ran if s > (steps[-1] if steps else 0))
        if len(after) == 1:
            done += (
                f" (step {after[0]} ran but is not committed: a step commits with its checkpoint, "
                "run.checkpoint_every = 1; a resume redoes it)"
            )
        assert len(after) <= 1, f"steps {after} ran after the last checkpoint: {out[-3000:]}"
        resume = " ".join(["rollflow run", str(self.config), *self.overrides])
        assert stopped == [f"stopped by {how}: {done}; resume with: {resume}"], out[-3000:]
        return f"{signal.Signals(signum).name} {delay}s after {name}; exit in {took:.1f}s"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # a test failed mid-launch
            self.kill_run(self.proc)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(
        self,
        proc: subprocess.Popen,
        done: Callable[[], bool],
        what: str,
        timeout_s: float = START_TIMEOUT_S,
        poll_s: float = 0.01,
    ) -> None:
        """Until ``done()``; every 10 ms by default, so that a kill point lands where it was
        drawn (a condition that scans every process asks less often: ``poll_s``)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert proc.poll() is None, (
                f"run exited (code {proc.returncode}) before {what}:\n{self.output()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no {what} within {timeout_s:.0f}s:\n{self.output()[-4000:]}"
            )
            time.sleep(poll_s)

    def kill_run(self, proc: subprocess.Popen) -> None:
        """SIGKILL the run; every service dies with it within seconds."""
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.assert_no_orphans()

    def assert_no_orphans(self) -> None:
        deadline = time.monotonic() + 30
        while processes_marked(str(self.root)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [" ".join(p.cmdline()[:4]) for p in processes_marked(str(self.root))]
        assert not left, f"processes outlived the run: {left}"

    # ------------------------------------------------------------------ storage

    def committed(self, kind: str = "checkpoints") -> list[int]:
        return sorted(
            int(p.parent.name.split("=")[1]) for p in self.run_dir.glob(f"{kind}/step=*/_SUCCESS")
        )

    def committed_now(self, kind: str, step: int) -> bool:
        """Committed by the current launch (a marker from an earlier one does not count)."""
        marker = self.run_dir / kind / f"step={step}" / "_SUCCESS"
        try:
            return marker.stat().st_mtime >= self.launched_at
        except FileNotFoundError:
            return False

    def events(self, now: bool = False) -> list[dict]:
        """The run's events (``now``: those of the current launch only)."""
        try:
            with open(self.run_dir / "events.jsonl", "rb") as f:
                f.seek(self._events_read)
                added = f.read()
        except FileNotFoundError:
            added = b""
        whole = added[: added.rfind(b"\n") + 1]  # a line being written is read next time
        self._events_read += len(whole)
        self._events += [json.loads(line) for line in whole.splitlines() if line.endswith(b"}")]
        events = list(self._events)
        return [e for e in events if e["time"] >= self.launched_at] if now else events

    def published_now(self, version: int) -> bool:
        return any(
            e["event"] == "weights_published" and e["version"] == version
            for e in self.events(now=True)
        )

    def metrics(self, step: int) -> dict:
        import duckdb

        return (
            duckdb.sql(f"select * from '{self.run_dir}/metrics/step={step}.parquet'")
            .df()
            .iloc[0]
            .to_dict()
        )

    def random_kill_point(self, step: int) -> tuple[str, Callable[[], bool], float]:
        """A seeded random moment of ``step`` in this launch: one of its events, then a random
        delay. (A step whose committed rollouts are reused writes no rollouts: its weights'
        publication stands in.)"""
        kind = self.rng.choice(["rollouts", "batches", "weights", "checkpoints"])
        delay = round(self.rng.uniform(0.0, 0.8), 2)
        if kind == "weights":
            return f"weights_published({step})", lambda: self.published_now(step), delay
        return (
            f"{kind}/step={step} committed",
            lambda: self.committed_now(kind, step) or self.published_now(step),
            delay,
        )

    def parts(self, kind: str, steps: list[int]) -> list[str]:
        """The Parquet files of ``kind`` for ``steps``."""
        return [str(self.run_dir / kind / f"step={s}" / "part-0.parquet") for s in steps]

    def assert_consistent(self, final: bool = False) -> None:
        """Every committed step is in storage exactly once, whole, and its parts agree."""
        import duckdb

        steps = self.committed()
        assert steps == list(range(1, len(steps) + 1)), f"committed checkpoints {steps} have a gap"
        for kind in ("rollouts", "batches"):
            assert set(steps) <= set(self.committed(kind)), f"a committed step lacks its {kind}"
        assert {s for s in steps} <= {
            int(p.stem.split("=")[1]) for p in self.run_dir.glob("metrics/*.parquet")
        }
        committed = [e["step"] for e in self.events() if e["event"] == "step_committed"]
        assert len(committed) == len(set(committed)), f"a step committed twice: {committed}"
        rollout_steps = self.committed("rollouts")
        if rollout_steps:
            files = self.parts("rollouts", rollout_steps)
            per_step = duckdb.sql(
                f"select step, count(*), count(distinct (group_index, sample_index)), "
                f"min(version_started) >= step - 2 and max(version_started) <= step - 1 "
                f"from read_parquet({files}) group by step order by step"
            ).fetchall()
            assert per_step == [(s, ROWS_PER_STEP, ROWS_PER_STEP, True) for s in rollout_steps], (
                per_step
            )
        batch_steps = self.committed("batches")
        if batch_steps:  # every trained row is a committed rollout of its step, token for token
            files, rollouts = (
                self.parts("batches", batch_steps),
                self.parts("rollouts", rollout_steps),
            )
            orphans = duckdb.sql(
                f"select b.step, b.group_index from read_parquet({files}) b anti join read_parquet({rollouts}) r "
                f"on b.step = r.step and b.group_index = r.group_index and b.sample_index = r.sample_index "
                f"and b.completion_ids = r.completion_ids"
            ).fetchall()
            assert not orphans, f"batch rows with no matching rollout: {orphans}"
        if final:
            for kind in ("rollouts", "batches", "checkpoints"):
                found = sorted(p.name for p in (self.run_dir / kind).iterdir())
                assert found == sorted(f"step={s}" for s in range(1, self.steps + 1)), (kind, found)
            metrics = sorted(
                int(p.stem.split("=")[1]) for p in self.run_dir.glob("metrics/*.parquet")
            )
            assert metrics == list(range(0, self.steps + 1))
            assert self.events()[-1]["event"] == "training_finished"


def open_campaign(
    tmp_path_factory, model_cache: Path, name: str, steps: int = STEPS
) -> Iterator[Campaign]:
    """A test file's campaign: its own run directory (a module-scoped fixture's body)."""
    c = Campaign(tmp_path_factory.mktemp(name), model_cache, name=name, steps=steps)
    yield c
    c.close()


def service_processes(marker: Path, module: str) -> list[psutil.Process]:
    """The run's processes running ``module`` (not its bash guard; vLLM: its API server and the
    engine core forked from it)."""
    return [
        p
        for p in processes_marked(str(marker))
        if module in " ".join(p.cmdline())
        and p.cmdline()[0] != "bash"
        and "-c" not in p.cmdline()[:2]
    ]


def service_process(marker: Path, module: str) -> psutil.Process:
    """The run's process running ``module`` (not its bash guard); the highest rank if several."""
    found = service_processes(marker, module)
    with_rank = [p for p in found if "RANK" in p.environ()]
    assert found, f"no process runs {module}"
    return max(with_rank, key=lambda p: int(p.environ()["RANK"])) if with_rank else found[0]


def flow_run_logs(api: str, run_name: str) -> str:
    """Every log message of the flow runs named ``run_name``, read back from the Prefect API."""
    runs = prefect_api(api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [run_name]}}})
    return flow_run_log(api, *(r["id"] for r in runs))
