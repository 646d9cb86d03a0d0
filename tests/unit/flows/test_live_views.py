"""The live views are drawn from the committed metrics in storage, never a step in flight
(flows/live_views.py)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from rollflow.flows import live_views
from rollflow.flows.live_views import LiveViews, curves_png, eta_text, snapshot
from rollflow.infra.metric_names import Metric, per_env
from rollflow.infra.storage import RunStorage
from rollflow.runs import CommittedMetrics, committed_metrics


def row(step: int) -> dict:
    out = {
        Metric.REWARD_MEAN: 0.1 * step,
        per_env(Metric.REWARD, "add"): 0.05 * step,
        per_env(Metric.REWARD, "sort"): 0.15 * step,
        per_env(Metric.NUM_ROLLOUTS, "add"): 16,
        per_env(Metric.NUM_ROLLOUTS, "sort"): 16,
        Metric.LOSS: 0.01 * step,
        Metric.KL: 0.001 * step,
        Metric.MISMATCH_KL: 0.0001,
        Metric.ENTROPY: 1.0 - 0.1 * step,
        Metric.COMPLETION_TOKENS_MEAN: 4.0 + step,
        Metric.COMPLETION_TOKENS_MAX: 6,
        Metric.STALENESS_MEAN: 0.5,
        Metric.STALENESS_MAX: 1,
        Metric.STEP_S: 30.0,  # two steps a minute
    }
    if step % 2 == 0:
        out |= {
            Metric.EVAL_REWARD: 0.2 + 0.1 * step,
            per_env(Metric.EVAL_REWARD, "add"): 0.1 * step,
            per_env(Metric.EVAL_REWARD, "sort"): 0.3 + 0.1 * step,
        }
    return out


@pytest.fixture
def storage(tmp_path) -> RunStorage:
    """Steps 1-3 committed (step 2 by its event alone: no checkpoint that step); step 4 wrote its
    metrics but did not commit (in flight, or a crash before its checkpoint)."""
    s = RunStorage(str(tmp_path), "live")
    s.write_metrics(0, {Metric.EVAL_REWARD: 0.1, per_env(Metric.EVAL_REWARD, "add"): 0.0})
    for step in range(1, 5):
        s.write_metrics(step, row(step))
    for step in (1, 3):
        s.commit("checkpoints", step)
    s.append_event("step_committed", step=2)
    s.write_metrics(5, {**row(5), Metric.REWARD_MEAN: 99.0})  # neither
    return s


def test_plot_table_and_pace_read_the_committed_steps_only(storage):
    snap = snapshot(storage)
    assert [r[Metric.STEP] for r in snap.rows] == [0, 1, 2, 3]
    assert snap.last_step == 3
    reward = snap.panels["reward"]
    assert reward["sampled"] == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.3)),
    ]
    assert reward["held-out"] == [(0, 0.1), (2, pytest.approx(0.4))]
    assert {"sampled add", "sampled sort", "held-out add", "held-out sort"} <= set(reward)
    for title, lines in snap.panels.items():  # nothing of step 4 or 5 in any panel
        assert lines, title
        assert max(s for points in lines.values() for s, _ in points) == 3, title
    assert set(snap.panels) == {
        "reward",
        "loss",
        "KL",
        "entropy",
        "completion tokens",
        "staleness (steps)",
    }

    add, sort = snap.envs
    assert add["env"] == "add" and sort["env"] == "sort"
    assert add["rollouts"] == 48 and add["steps sampled"] == 3  # 3 committed steps of 16
    assert add["reward (last step)"] == pytest.approx(0.15)
    assert add["held-out (first)"] == 0.0 and add["held-out (last)"] == pytest.approx(0.2)
    assert sort["held-out (first)"] == pytest.approx(0.5) and sort["held-out at step"] == 2

    assert snap.steps_per_min == pytest.approx(2.0)
    assert eta_text(snap, num_steps=10) == "2 steps/min, ETA 4 min"  # 7 steps left
    png = curves_png(snap)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and 5_000 < len(png) < 150_000


def test_a_run_without_committed_steps_draws_empty_panels(tmp_path):
    s = RunStorage(str(tmp_path), "fresh")
    s.write_metrics(1, row(1))  # in flight
    snap = snapshot(s)
    assert snap.last_step == 0 and snap.envs == [] and snap.steps_per_min is None
    assert all(not lines for lines in snap.panels.values())
    assert eta_text(snap, 10) == ""
    assert curves_png(snap).startswith(b"\x89PNG")


def test_redraws_every_n_committed_steps_off_the_loop_and_once_more_at_the_end(storage):
    drawn, threads = [], set()

    def publish(snap):
        drawn.append(snap.last_step)
        threads.add(threading.current_thread().name)

    live = LiveViews(storage, num_steps=10, every=2, publish=publish)
    live.committed(1)  # not due
    live.close()  # the end: all that is committed (step 3), on the views' thread
    assert drawn == [3] and threads == {"live-views"}

    live = LiveViews(storage, num_steps=10, every=3, publish=publish)
    drawn.clear()
    live.committed(3)
    live.close()  # step 3 drawn already: the end redraws nothing new
    assert drawn == [3]

    live = LiveViews(storage, num_steps=10, every=0, publish=publish)
    drawn.clear()
    live.committed(2)
    assert live._thread is None  # 0: only at the end
    live.close(final=False)  # a failed run: no redraw, no wait
    assert drawn == []


def test_a_redraw_reads_again_only_the_rows_that_can_change(storage):
    """Steps at or before the last checkpoint are never redone: their files are read once. A step
    committed by its event after it may be redone after a lost trainer, and is read each time."""
    metrics = CommittedMetrics(storage)
    assert metrics.read() == committed_metrics(storage)  # steps 0-3
    assert metrics.files_read == 4
    assert metrics.read() == committed_metrics(storage)
    assert metrics.files_read == 5  # step 0 only: 1-3 are at or before checkpoint 3

    storage.append_event("step_committed", step=4)  # committed, no checkpoint yet
    assert [r[Metric.STEP] for r in metrics.read()] == [0, 1, 2, 3, 4]
    storage.write_metrics(4, {**row(4), Metric.REWARD_MEAN: 7.0})  # step 4 redone
    assert metrics.read()[-1][Metric.REWARD_MEAN] == 7.0
    assert metrics.files_read == 9
    storage.commit("checkpoints", 4)
    metrics.read()
    before = metrics.files_read
    assert metrics.read() == committed_metrics(storage)
    assert metrics.files_read == before + 1  # step 4 is kept now


def test_redraws_are_paced_to_their_share_of_the_time_but_the_last_is_not(storage):
    starts = []

    def publish(snap):
        starts.append(time.monotonic())
        time.sleep(0.05)

    live = LiveViews(storage, num_steps=10, every=1, publish=publish, share=0.2)
    live.committed(1)
    deadline = time.monotonic() + 30
    while not live.drawn and time.monotonic() < deadline:
        time.sleep(0.01)
    live.committed(2)
    live.committed(3)  # both fall due while the next redraw waits: one redraw
    while len(live.drawn) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.drawn == [3, 3] and len(starts) == 2
    # The second began no sooner than the first's duration (≥ 0.05 s) / 0.2 after the first.
    assert starts[1] - starts[0] >= 0.25

    slow = LiveViews(storage, num_steps=10, every=1, publish=publish, share=1e-4)
    slow.committed(1)
    while not slow.drawn and time.monotonic() < deadline:
        time.sleep(0.01)
    storage.append_event("step_committed", step=4)  # a newer step to draw at the end
    closed_at = time.monotonic()
    slow.close()  # its pace would wait ≥ 500 s: the end draws at once
    assert slow.drawn == [3, 4] and time.monotonic() - closed_at < 20


def test_a_redraw_that_cannot_read_storage_is_a_warning(tmp_path, monkeypatch, caplog):
    live = LiveViews(RunStorage(str(tmp_path), "gone"), 10, 1, publish=lambda s: None)

    def broken(storage, metrics=None):
        raise OSError("unreachable")

    monkeypatch.setattr(live_views, "snapshot", broken)
    assert live.refresh() is None
    assert "could not read the committed metrics for the live views: OSError" in caplog.text


def test_the_eta_reads_as_minutes_or_hours():
    assert live_views._duration(45) == "45 s"
    assert live_views._duration(600) == "10 min"
    assert live_views._duration(3 * 3600 + 60) == "3 h 01 min"
    assert math.isclose(live_views.steps_per_minute([{Metric.STEP_S: 15.0}]), 4.0)
