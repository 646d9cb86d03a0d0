"""Fault tests of a whole run, part 1: the run SIGKILLed at random moments, stopped by Ctrl-C and
SIGTERM, its vLLM killed.

One run directory goes through every fault in turn (one model cache, one warm start), each
launch resuming where the last one stopped (tests/chaos_support.py):

1. the run is SIGKILLed at seeded random points: during service start-up, after a random event
   of a step plus a random delay (on the run's own Prefect API, which must die with it), and at
   ``max_staleness = 1`` right after a future step's rollouts were committed (the resume rule
   must then reuse or regenerate them);
2. Ctrl-C (SIGINT), on that rerun, and SIGTERM, on the next launch, at a seeded random point of
   a step: the run stops within 30 s and prints one line (no traceback) saying what is committed
   and the command that resumes it;
3. the vLLM server is killed mid-step (frozen first, so that requests are surely in flight): the
   run notices within 30 s, restarts it, retries its rollouts and goes on;
4. in that launch, the inference fleet grows from one server to two (`rollflow scale`), and
   shrinks back when server 1 is preempted (asked to go and SIGKILLed at once); the run goes on
   with one server, every step once, until a SIGTERM.

After every fault no process of the run is left, and storage holds every committed step once:
rollouts, batches, metrics and checkpoints, checked with DuckDB. Part 2, with a run directory of
its own: test_chaos_trainer.py.
"""

from __future__ import annotations

import itertools
import re
import signal
import time
from collections.abc import Iterator

import psutil
import pytest

from rollflow.cli import main as rollflow

from chaos_support import SEED, STEPS, Campaign, open_campaign, service_process, service_processes

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
# Room for the fleet's second server (slot 1); a preemption that lands mid-sync waits for the
# weight group's deadline (as on NCCL): 30 s, not the default 120 s, bounds that wait here.
FLEET_LAUNCH = ("inference.max_servers=2", "trainer.weight_sync_timeout_s=30")


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, model_cache) -> Iterator[Campaign]:
    # The session's Prefect API for the launches saves its start-up each time; one launch starts
    # its own, as a run without a configured server does (and it must die with the run).
    # Room for the fleet's grow in the last launch: a vLLM start takes 20-90 s, a tiny step ~1 s
    # (the launch is stopped once the fleet is back to one server).
    yield from open_campaign(tmp_path_factory, model_cache, "chaos-run", steps=STEPS + 300)


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


def test_sigkill_after_a_future_steps_rollouts_were_committed_then_ctrl_c(campaign):
    """S = 1 generates a step ahead: killed right after step C+2's rollouts were committed (C:
    the last checkpoint), the rerun must reuse them (versions within the bound) or regenerate them;
    then Ctrl-C at a random point of a later step stops it with one line."""
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

    # The rerun applies the resume rule to them, goes past them, and is stopped by Ctrl-C.
    proc = c.launch("train.max_staleness=1")
    what = c.stop_at_random_point(proc, len(c.committed()) + 2, signal.SIGINT)
    reuse = re.search(r"reusing the committed rollouts of steps \[.*\]", c.output())
    print(
        f"seed {SEED}: rerun stopped by {what}; {reuse.group(0) if reuse else 'no rollouts reused'}"
    )


def test_vllm_killed_mid_step_is_restarted_and_the_run_goes_on(campaign):
    """The launch goes on into the next test (the fleet's), which stops it."""
    c = campaign
    step = len(c.committed()) + 1
    proc = c.launch("train.max_staleness=0", *FLEET_LAUNCH)
    # Once step N's weights are out, step N+1's requests go to vLLM at once: freeze it so that
    # they are surely in flight, then kill it.
    # Found first: scanning the processes takes long enough for a tiny step's requests to finish.
    found: list[psutil.Process] = []

    def vllm_started() -> bool:
        try:
            found.append(service_process(c.root, "vllm.entrypoints.openai.api_server"))
        except AssertionError:  # not spawned yet
            return False
        return True

    # Every 0.25 s: each look reads every process's command line and environment, and vLLM is
    # needed only once step N's weights are out, tens of seconds later.
    c.wait_for(proc, vllm_started, "the vLLM server's process", poll_s=0.25)
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


def test_the_fleet_grows_and_shrinks_with_a_preemption_and_the_run_goes_on(campaign):
    """`rollflow scale` to 2 once this launch has published weights: server 1 starts, joins the
    weight group, and serves; then `rollflow scale` to 1 and server 1 SIGKILLed at once (a
    preemption): it leaves (not restarted), its requests are retried on server 0, and the run
    goes on with one server. Every step once, and the steps' metrics show the fleet over time."""
    c = campaign
    # The vLLM-killed test's launch, going on (one launch fewer); its own if that one ended.
    proc = c.proc if c.proc is not None and c.proc.poll() is None else c.launch(*FLEET_LAUNCH)
    first = len(c.committed()) + 1
    c.wait_for(proc, lambda: c.published_now(first), f"weights_published({first})")
    scale = ["scale", c.name, "--storage", str(c.run_dir.parent), "--servers"]
    assert rollflow([*scale, "2"]) == 0

    def fleet_event(key: str) -> dict | None:
        changes = [e for e in c.events(now=True) if e["event"] == "fleet_changed"]
        return next((e for e in changes if key in e), None)

    def a_step_sampled_by(servers: int, after: int) -> int | None:
        """The first step after ``after`` committed by this launch whose rollouts were taken
        with ``servers`` in the fleet (the join or leave lands between a sync and the next take,
        so which step is the first one is a race: read it, do not guess it)."""
        for step in c.committed():
            if step > after and c.committed_now("checkpoints", step):
                if step not in sampled_by:  # a committed step's metrics never change: read once
                    sampled_by[step] = c.metrics(step).get("inference_servers")
                if sampled_by[step] == servers:
                    return step
        return None

    sampled_by: dict[int, float] = {}  # step → its metric inference_servers

    c.wait_for(proc, lambda: fleet_event("joined") is not None, "server 1 joined", timeout_s=300)
    joined = fleet_event("joined")
    c.wait_for(
        proc, lambda: a_step_sampled_by(2, first), "a step sampled by both servers", timeout_s=120
    )
    grown = a_step_sampled_by(2, first)
    port = joined["url"].rsplit(":", 1)[1]
    [server1] = [
        p for p in service_processes(c.root, "vllm.entrypoints") if port in " ".join(p.cmdline())
    ]
    assert rollflow([*scale, "1"]) == 0
    server1.send_signal(signal.SIGKILL)
    # Within the health check's 5 s, unless a sync was under way to the killed server: then its
    # broadcast first meets the weight group's deadline (trainer.weight_sync_timeout_s, 30 s in
    # FLEET_LAUNCH; it was 120 s, and a suite's fleet test took 177 s instead of 68 s for it).
    c.wait_for(proc, lambda: fleet_event("left") is not None, "server 1 left", timeout_s=120)
    left = fleet_event("left")
    assert (left["servers"], left["left"], left["preempted"]) == (1, 1, True)
    c.wait_for(
        proc, lambda: a_step_sampled_by(1, grown), "a step sampled by server 0 alone", timeout_s=120
    )
    shrunk = a_step_sampled_by(1, grown)
    print(
        f"server 1 joined in {joined['join_s']:.0f}s (version {joined['version']}); preempted "
        f"after step {grown}, out in {left['leave_s']:.1f}s; then "
        f"{c.stop_at_random_point(proc, shrunk + 1, signal.SIGTERM)}"
    )
    out = c.output()
    assert "fleet: vLLM server 1 joined in" in out and "Traceback" not in out
    assert "fleet: vLLM server 1 left (it was down: preempted)" in out
    c.assert_consistent()
    fleet = [
        (step, c.metrics(step).get("inference_servers")) for step in c.committed()[first - 1 :]
    ]
    # One server, then two, then one (a step that reused committed rollouts has no count).
    sizes = [n for _, n in fleet if n is not None and n == n]
    assert [n for n, _ in itertools.groupby(sizes)] == [1, 2, 1], fleet
    end = c.metrics(c.committed()[-1])
    assert end["inference/1/requests"] > 0 and end["inference/1/first_request_s"] >= 0
