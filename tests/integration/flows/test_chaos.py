"""Fault tests of a whole run: SIGKILLed at random moments, its vLLM killed, Ctrl-C and SIGTERM,
its trainer killed.

One run directory goes through every fault in turn (one model cache, one warm start), each
launch resuming where the last one stopped:

1. the run is SIGKILLed at seeded random points: during service start-up, after a random event
   of a step plus a random delay, and at ``max_staleness = 1`` right after a future step's
   rollouts were committed (the resume rule must then reuse or regenerate them);
2. the vLLM server is killed mid-step (frozen first, so that requests are surely in flight): the
   run notices within 30 s, restarts it, retries its rollouts and goes on (then is SIGKILLed);
3. Ctrl-C (SIGINT) and SIGTERM at a seeded random point of a step: the run stops within 30 s and
   prints one line (no traceback) saying what is committed and the command that resumes it;
4. the trainer is killed: the run fails within 60 s naming it; a rerun (the printed command)
   resumes and completes, and its progress lines are in its flow runs' logs on the Prefect API.

After every fault no process of the run is left, and storage holds every committed step once:
rollouts, batches, metrics and checkpoints, checked with DuckDB. The seed (``ROLLFLOW_CHAOS_SEED``)
and every kill point are printed. The tests also pass one by one, from an empty run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rollflow.trainer import SERVICE_MODULE

from deployed_run import processes_marked
from run_support import ROOT, env_for, session_prefect_api, write_config

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
SEED = int(os.environ.get("ROLLFLOW_CHAOS_SEED", "6"))
STEPS = 14  # room for every fault's steps before the last launch completes the run
ROWS_PER_STEP = 8 * 4  # train_batch_size x group_size of run_support.SMALL
START_TIMEOUT_S = 300.0  # a launch's first step: Prefect API, vLLM start-up (slow on busy CI)


class Campaign:
    """One run directory killed again and again; launches, kill points and checks."""

    def __init__(self, root: Path, model_cache: Path):
        self.root, self.prefect_api = root, session_prefect_api()
        self.config = write_config(root, model_cache, name="chaos", steps=STEPS)
        self.run_dir = root / "runs" / "chaos"
        self.rng = random.Random(SEED)
        self.launches = 0
        self.proc: subprocess.Popen | None = None
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
        self.launched_at = time.time()
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
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert proc.poll() is None, (
                f"run exited (code {proc.returncode}) before {what}:\n{self.output()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no {what} within {timeout_s:.0f}s:\n{self.output()[-4000:]}"
            )
            time.sleep(0.01)

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
            lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line.endswith("}")]
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
            files = [
                str(self.run_dir / "rollouts" / f"step={s}" / "part-0.parquet")
                for s in rollout_steps
            ]
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
            files = [
                str(self.run_dir / "batches" / f"step={s}" / "part-0.parquet") for s in batch_steps
            ]
            rollouts = [
                str(self.run_dir / "rollouts" / f"step={s}" / "part-0.parquet")
                for s in rollout_steps
            ]
            orphans = duckdb.sql(
                f"select b.step, b.group_index from read_parquet({files}) b anti join read_parquet({rollouts}) r "
                f"on b.step = r.step and b.group_index = r.group_index and b.sample_index = r.sample_index "
                f"and b.completion_ids = r.completion_ids"
            ).fetchall()
            assert not orphans, f"batch rows with no matching rollout: {orphans}"
        if final:
            for kind in ("rollouts", "batches", "checkpoints"):
                found = sorted(p.name for p in (self.run_dir / kind).iterdir())
                assert found == sorted(f"step={s}" for s in range(1, STEPS + 1)), (kind, found)
            metrics = sorted(
                int(p.stem.split("=")[1]) for p in self.run_dir.glob("metrics/*.parquet")
            )
            assert metrics == list(range(0, STEPS + 1))
            assert self.events()[-1]["event"] == "training_finished"


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, model_cache) -> Campaign:
    # The session's Prefect API for the launches saves its start-up each time; two launches start
    # their own as a run without a configured server does (a SIGKILLed one, a failing one).
    c = Campaign(tmp_path_factory.mktemp("chaos"), model_cache)
    yield c
    c.close()


def test_sigkill_during_service_start_up(campaign):
    """Prefect API, vLLM and trainer half started, nothing written yet: nothing may be left."""
    c = campaign
    vllm_log = c.run_dir / "logs" / "vllm.log"
    size = vllm_log.stat().st_size if vllm_log.exists() else -1
    proc = c.launch()
    c.wait_for(
        proc, lambda: vllm_log.exists() and vllm_log.stat().st_size != size, "service start-up"
    )
    delay = round(c.rng.uniform(0.0, 8.0), 2)
    time.sleep(delay)
    c.kill_run(proc)
    print(f"kill: {delay}s into service start-up; committed {c.committed()[-1:]}")
    c.assert_consistent()


def test_sigkill_at_a_random_point_of_a_step(campaign):
    """On the run's own Prefect API, which must die with it too."""
    c = campaign
    what = c.kill_at_random_point(len(c.committed()) + 1, "train.max_staleness=0", private_api=True)
    print(f"kill at max_staleness=0: {what}")


def test_sigkill_after_a_future_steps_rollouts_were_committed_then_rerun(campaign):
    """S = 1 generates a step ahead: killed right after step C+2's rollouts were committed (C:
    the last checkpoint), the rerun must reuse them (versions within the bound) or regenerate them."""
    c = campaign
    step = len(c.committed()) + 2
    proc = c.launch("train.max_staleness=1")
    c.wait_for(proc, lambda: c.committed_now("rollouts", step), f"rollouts/step={step} committed")
    c.kill_run(proc)
    ahead = [s for s in c.committed("rollouts") if s > len(c.committed())]
    print(
        f"kill at S=1 after rollouts/step={step} committed: rollouts of steps {ahead} are ahead of "
        f"checkpoint {c.committed()[-1:]}"
    )
    assert ahead, "the kill was meant to leave committed rollouts of a future step"
    c.assert_consistent()

    # The rerun applies the resume rule to them, goes past them, and is killed at a random point.
    what = c.kill_at_random_point(len(c.committed()) + 2, "train.max_staleness=1")
    reuse = re.search(r"reusing the committed rollouts of steps \[.*\]", c.output())
    print(f"rerun killed {what}; {reuse.group(0) if reuse else 'no rollouts reused'}")


def test_vllm_killed_mid_step_is_restarted_and_the_run_goes_on(campaign):
    c = campaign
    step = len(c.committed()) + 1
    proc = c.launch("train.max_staleness=0")
    # Once step N's weights are out, step N+1's requests go to vLLM at once: freeze it so that
    # they are surely in flight, then kill it.
    # Found first: scanning the processes takes long enough for a tiny step's requests to finish.
    found: list[psutil.Process] = []

    def vllm_started() -> bool:
        try:
            found.append(_service_process(c.root, "vllm.entrypoints.openai.api_server"))
        except AssertionError:  # not spawned yet
            return False
        return True

    c.wait_for(proc, vllm_started, "the vLLM server's process")
    vllm = found[-1]
    c.wait_for(proc, lambda: c.published_now(step), f"weights_published({step})")
    vllm.send_signal(signal.SIGSTOP)
    time.sleep(1.0)
    killed_at = time.time()
    vllm.send_signal(signal.SIGKILL)
    print(f"vLLM killed during step {step + 1}")
    c.wait_for(
        proc,
        lambda: any(e["event"] == "inference_restarted" for e in c.events(now=True)),
        "inference_restarted",
    )
    restart = next(e for e in c.events(now=True) if e["event"] == "inference_restarted")
    print(
        f"restart: detected {restart['detected_at'] - killed_at:.1f}s after the kill, restarted in "
        f"{restart['restart_s']:.0f}s, serving version {restart['version']}"
    )
    assert restart["detected_at"] - killed_at < 30
    assert restart["version"] >= step
    c.wait_for(proc, lambda: c.committed_now("checkpoints", step + 1), f"step {step + 1} committed")
    after, before = c.metrics(step + 1), c.metrics(step).get("retries_total")
    assert after["inference_restarts"] == 1
    # Its requests were retried (a step whose rollouts were reused has no count of its own).
    assert after["retries_total"] > (0 if before is None or before != before else before)
    assert "inference: restarted in" in c.output()
    name, reached, delay = c.random_kill_point(step + 2)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    c.kill_run(proc)
    print(f"kill: {delay}s after {name}; committed {c.committed()[-1:]}")
    c.assert_consistent()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_at_a_random_point_of_a_step_prints_one_line(campaign, signum):
    c = campaign
    before = c.committed()
    step = len(before) + 1
    proc = c.launch("train.max_staleness=1")
    name, reached, delay = c.random_kill_point(step)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    proc.send_signal(signum)
    sent = time.monotonic()
    proc.wait(timeout=60)
    took = time.monotonic() - sent
    print(f"seed {SEED}: {signal.Signals(signum).name} {delay}s after {name}; exit in {took:.1f}s")
    c.assert_no_orphans()
    c.assert_consistent()
    out = c.output()
    assert took < 30, out[-3000:]
    assert proc.returncode == 128 + signum, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("error")], out[-3000:]
    how = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    stopped = [line for line in out.splitlines() if line.startswith("stopped")]
    steps = c.committed()
    done = (
        f"committed through step {steps[-1]} of {STEPS} in {c.run_dir}"
        if steps
        else f"no step committed yet in {c.run_dir}"
    )
    resume = f"rollflow run {c.config} train.max_staleness=1"
    assert stopped == [f"stopped by {how}: {done}; resume with: {resume}"], out[-3000:]


@pytest.mark.parametrize("point", ["checkpoint_upload", "weight_broadcast"])
def test_trainer_killed_at_a_fault_point_fails_the_run_then_nothing_half_done_counts(
    campaign, point
):
    """SIGKILL inside a checkpoint's upload (files there, no _SUCCESS) or inside a weight
    broadcast (header sent, weights not): moments too short to hit from outside, so the trainer
    kills itself at a fault point (infra/faults.py), on its seeded n-th passage."""
    c = campaign
    nth = c.rng.randint(1, 3)
    before = c.committed()
    proc = c.launch("train.max_staleness=0", env={"ROLLFLOW_FAULT": f"{point}@{nth}"})
    code = proc.wait(timeout=START_TIMEOUT_S + 120)
    errors = re.findall(r"^error: .*$", c.output(), re.M)
    print(f"fault {point}@{nth}: exit {code}; {errors[-1] if errors else 'no error line'}")
    assert code == 1, c.output()[-3000:]
    assert len(errors) == 1 and "Traceback" not in c.output(), c.output()[-3000:]
    assert re.search(r"trainer.*(died|dead|exited)", errors[0]), errors[0]
    c.assert_no_orphans()
    c.assert_consistent()
    if point == "checkpoint_upload":  # the upload was cut: its step is not committed
        cut = len(before) + nth
        assert cut not in c.committed(), (cut, c.committed())
        assert (c.run_dir / "checkpoints" / f"step={cut}").exists()  # half there, not counted


def test_trainer_killed_fails_the_run_fast_naming_it_then_a_rerun_completes(campaign):
    c = campaign
    proc = c.launch("train.max_staleness=0", private_api=True)
    name, reached, delay = c.random_kill_point(len(c.committed()) + 1)
    c.wait_for(proc, reached, name)
    time.sleep(delay)
    victim = _service_process(c.root, SERVICE_MODULE)
    rank = victim.environ().get("RANK")  # a multi-rank trainer: kill a rank, expect it named
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=120)
    failed_s = time.monotonic() - killed_at
    errors = re.findall(r"^error: .*$", c.output(), re.M)
    assert len(errors) == 1 and "Traceback" not in c.output(), c.output()[-3000:]
    last_error = errors[0]
    print(
        f"trainer{f' rank {rank}' if rank else ''} killed {delay}s after {name}: the run failed "
        f"in {failed_s:.1f}s with: {last_error}"
    )
    assert code != 0 and failed_s < 60
    assert re.search(r"trainer.*(died|dead|exited)", last_error), last_error
    if rank is not None:
        assert f"rank {rank}" in last_error
    c.assert_no_orphans()
    c.assert_consistent()

    # The rerun, as a stopped run prints it: it resumes after the last committed step and
    # finishes; its progress lines are in its flow runs' logs on the Prefect API (the UI's Logs).
    before = c.committed()
    proc = c.launch("train.max_staleness=1")
    assert proc.wait(timeout=600) == 0, c.output()[-4000:]
    if before:
        assert f"resuming after committed step {before[-1]}" in c.output()
    c.assert_no_orphans()
    c.assert_consistent(final=True)
    logs = flow_run_logs(c.prefect_api, "chaos")
    assert f"step {STEPS}/{STEPS}: reward" in logs, logs[-3000:]
    assert "services: vLLM at" in logs and "done: held-out reward" in logs


def _service_process(marker: Path, module: str) -> psutil.Process:
    """The run's process running ``module`` (not its bash guard); the highest rank if several."""
    found = [
        p
        for p in processes_marked(str(marker))
        if module in " ".join(p.cmdline())
        and p.cmdline()[0] != "bash"
        and "-c" not in p.cmdline()[:2]
    ]
    with_rank = [p for p in found if "RANK" in p.environ()]
    assert found, f"no process runs {module}"
    return max(with_rank, key=lambda p: int(p.environ()["RANK"])) if with_rank else found[0]


def flow_run_logs(api: str, run_name: str) -> str:
    """Every log message of the flow runs named ``run_name``, read back from the Prefect API."""
    import httpx

    runs = httpx.post(
        f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [run_name]}}}, timeout=10
    ).json()
    ids = [r["id"] for r in runs]
    messages, offset = [], 0
    while True:
        page = httpx.post(
            f"{api}/logs/filter",
            json={"logs": {"flow_run_id": {"any_": ids}}, "offset": offset, "limit": 200},
            timeout=10,
        ).json()
        messages += [log["message"] for log in page]
        offset += len(page)
        if len(page) < 200:
            return "\n".join(messages)
