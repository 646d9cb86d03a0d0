"""The lines and the deadline of a service's outage (infra/outage.py), on a fake clock."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rollflow.infra import outage as outage_mod
from rollflow.infra.outage import OutageStop, Watch, api_outage, storage_outage

MINIMAL = {"model": {"path": "unused"}, "envs": [{"name": "add"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def made(kind, deadline_s=60.0):
    clock, lines, stops = Clock(), [], []
    wall = lambda: 1_700_000_000.0 + clock.now  # noqa: E731
    make = api_outage if kind == "api" else storage_outage
    where = "http://127.0.0.1:4200/api" if kind == "api" else "s3://bucket/runs/r"
    out = make(where, deadline_s, lines.append, stops.append, clock=clock, wall=wall)
    return out, clock, lines, stops


def test_the_api_is_one_line_when_lost_one_when_back_however_many_probes_fail():
    out, clock, lines, stops = made("api")
    out.answered()
    for _ in range(10):
        out.failed()
        clock.now += 2
    assert len(lines) == 1 and out.down and not out.wait_up(0)
    assert lines[0].startswith("Prefect API at http://127.0.0.1:4200/api not answering since ")
    assert lines[0].endswith("; steps wait for it")
    out.answered()
    out.answered()
    assert lines[1:] == ["Prefect API at http://127.0.0.1:4200/api answering again after 20 s"]
    assert not out.down and out.wait_up(0) and stops == [] and out.outages == [20.0]


def test_storage_says_nothing_for_a_few_seconds_of_silence_then_one_line():
    out, clock, lines, _ = made("storage")
    for _ in range(4):  # 8 s: a slow request, not an outage
        out.failed()
        clock.now += 2
    out.answered()
    assert lines == [] and out.outages == []
    for _ in range(7):
        out.failed()
        clock.now += 2
    out.answered()
    assert lines == [
        "storage s3://bucket/runs/r not answering for 10 s; waiting",
        "storage s3://bucket/runs/r answering again after 14 s",
    ]


@pytest.mark.parametrize("kind, setting", [("api", "api"), ("storage", "storage")])
def test_past_the_deadline_the_run_is_stopped_once_naming_the_setting(kind, setting):
    out, clock, lines, stops = made(kind, deadline_s=30)
    for _ in range(40):
        out.failed()
        clock.now += 1
    assert len(stops) == 1 and f"(run.{setting}_outage_timeout_s = 30)" in stops[0]
    assert "not answering for 30 s" in stops[0] and len(lines) == 1


def test_a_watch_probes_in_its_thread_and_a_hung_probe_counts_as_no_answer():
    answers = threading.Event()
    lines = []
    out = storage_outage("s3://b/r", 0.3, lines.append, lambda reason: None)
    out.notice_s = 0.1

    def probe():
        if not answers.is_set():
            time.sleep(1)  # hangs past the probe's deadline
        return True

    with Watch(out, probe, every_s=0.05, timeout_s=0.05):
        deadline = time.monotonic() + 5
        while not out.stopped and time.monotonic() < deadline:
            time.sleep(0.02)
        answers.set()
        while out.down and time.monotonic() < deadline:
            time.sleep(0.02)
    assert out.stopped and not out.down
    assert lines[0].endswith("; waiting") and "answering again" in lines[-1]


def test_stop_main_raises_outage_stop_in_the_main_thread(monkeypatch):
    import logging

    monkeypatch.setattr(outage_mod, "_pending", [])
    monkeypatch.setattr(logging, "raiseExceptions", True)
    previous = signal.getsignal(outage_mod._STOP_SIGNAL)
    outage_mod.install_stop_handler()
    try:
        with pytest.raises(OutageStop) as stopped:
            threading.Thread(target=outage_mod.stop_main, args=("storage x gone",)).start()
            time.sleep(5)
        assert stopped.value.reason == "storage x gone"
        assert not logging.raiseExceptions  # Prefect's log worker prints nothing on the way out
        assert isinstance(stopped.value, KeyboardInterrupt)
    finally:
        signal.signal(outage_mod._STOP_SIGNAL, previous)


def test_prefects_retry_back_off_waits_out_the_outage_and_ends_at_once_past_its_deadline():
    import prefect.client.base as base

    out = api_outage("http://x/api", 60, lambda line: None, lambda reason: None)
    with outage_mod.patient_prefect_client(out, cap_s=0.01):
        started = time.monotonic()
        base.time.sleep(30)  # Prefect's back-off of 32 s: at most the cap while the API is up
        assert time.monotonic() - started < 1
        out.noticed = True
        out._up.clear()
        threading.Timer(0.3, out.answered).start()
        out.silent_since = time.monotonic()
        started = time.monotonic()
        base.time.sleep(30)  # while it is down: until it is back
        assert 0.25 < time.monotonic() - started < 2
        out.noticed, out.stopped = True, True  # past the deadline: no back-off at all
        started = time.monotonic()
        base.time.sleep(30)
        assert time.monotonic() - started < 0.1
    # After a stop for the outage the patch stays: the run's last reports fail at once.
    assert isinstance(base.time, outage_mod._PatientTime)
    import anyio

    base.time, base.anyio = time, anyio


def test_silence_counts_from_when_the_unanswered_probe_was_sent_and_runs_while_it_is_out():
    out, clock, lines, _ = made("storage")
    out.failed(since=clock.now - 3)  # a probe sent 3 s ago timed out now
    clock.now += 6.5
    out.failed()  # the next probe still out: 9.5 s of silence, nothing said yet
    assert lines == []
    clock.now += 0.5
    out.failed()
    assert lines == ["storage s3://bucket/runs/r not answering for 10 s; waiting"]


def test_the_stop_line_names_the_outage_and_its_setting_and_still_says_how_to_resume(tmp_path):
    from rollflow.infra.config import validate_config
    from rollflow.infra.terminal import stopped_line

    cfg = validate_config(
        {"run": {"name": "r", "storage": str(tmp_path)}, **MINIMAL}  # no step committed
    )
    reason = "storage s3://b/r not answering for 600 s (run.storage_outage_timeout_s = 600)"
    line = stopped_line(OutageStop(reason), cfg, "c.toml", ["run.num_steps=40"])
    assert line == (
        f"stopped: {reason}: no step committed yet in {tmp_path}/r; "
        "resume with: rollflow run c.toml run.num_steps=40"
    )


@pytest.mark.parametrize(
    ("checkpointed", "ran", "says"),
    [
        ([], [0], "no step committed yet in {where}"),
        (
            [],
            [0, 1, 2, 3],
            "no step committed yet in {where} (steps 1-3 ran but are not committed: a step "
            "commits with its checkpoint, run.checkpoint_every = 5; a resume redoes them)",
        ),
        (
            [5],
            [0, 1, 2, 3, 4, 5, 6],
            "committed through step 5 of 40 in {where} (step 6 ran but is not committed: a step "
            "commits with its checkpoint, run.checkpoint_every = 5; a resume redoes it)",
        ),
        ([5], [0, 1, 2, 3, 4, 5], "committed through step 5 of 40 in {where}"),
    ],
)
def test_the_stop_line_names_the_steps_a_resume_redoes(tmp_path, checkpointed, ran, says):
    """A run stopped after steps that wrote their metrics but no checkpoint: "no step committed"
    alone read as nothing done, after a run that had printed eight steps."""
    from rollflow.infra.config import validate_config
    from rollflow.infra.storage import RunStorage
    from rollflow.infra.terminal import Stopped, stopped_line

    cfg = validate_config(
        {"run": {"name": "r", "storage": str(tmp_path), "checkpoint_every": 5}, **MINIMAL}
    )
    storage = RunStorage(str(tmp_path), "r")
    for step in ran:
        storage.write_metrics(step, {"step_s": 1.0})
    for step in checkpointed:
        storage.write_json(f"checkpoints/step={step}/_SUCCESS", {})
    line = stopped_line(Stopped(), cfg, "c.toml", ["run.num_steps=40"])
    where = f"{tmp_path}/r"
    assert line == f"stopped by SIGTERM: {says.format(where=where)}; resume with: " + (
        "rollflow run c.toml run.num_steps=40"
    )


def test_the_stop_line_does_not_wait_on_a_storage_that_does_not_answer(monkeypatch, tmp_path):
    from rollflow.infra import terminal
    from rollflow.infra.config import validate_config
    from rollflow.infra.storage import RunStorage

    monkeypatch.setattr(terminal, "STOP_READ_DEADLINE_S", 0.2)
    monkeypatch.setattr(RunStorage, "committed_steps", lambda self, kind: time.sleep(5))
    cfg = validate_config({"run": {"name": "r", "storage": str(tmp_path)}, **MINIMAL})
    started = time.monotonic()
    line = terminal.stopped_line(OutageStop("storage x not answering"), cfg, "c.toml", [])
    assert time.monotonic() - started < 2
    assert line == (
        "stopped: storage x not answering: committed steps unknown; resume with: rollflow run c.toml"
    )
