"""UI artifacts: published under a local Prefect API and read back through the client."""

from __future__ import annotations

import base64
import json
import logging
import re
import time
import uuid

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.settings import PREFECT_API_URL, temporary_settings

from rollflow.flows import artifacts, live_views
from rollflow.flows.artifacts import (
    RunProgress,
    artifact_key,
    publish_step_metrics,
    publish_summary,
)
from rollflow.flows.live_views import LiveViews
from rollflow.infra.storage import RunStorage

from run_support import session_prefect_api

NUM_STEPS = 4
UI_EVERY = 2  # metrics.ui_every of the fake run: the live views redrawn at steps 2 and 4


@pytest.fixture(scope="module")
def prefect_api():
    # The session's Prefect API (tests/run_support.py), as this process's configured server.
    with temporary_settings(updates={PREFECT_API_URL: session_prefect_api()}) as settings:
        yield settings.api.url


def read_artifacts(key: str) -> list:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return sorted(found, key=lambda a: a.created)


def fake_metrics(step: int) -> dict:
    row = {
        "reward_mean": 0.1 * step,
        "reward/add": 0.05 * step,
        "reward/sort_letters": 0.15 * step,
        "num_rollouts/add": 16,
        "num_rollouts/sort_letters": 16,
        "num_groups_kept": 8,
        "loss": float("nan"),
        "entropy": 1.0 - 0.1 * step,
        "step_s": 1.5,
    }
    if step % 2 == 0:
        row["eval_reward"] = 0.2 + 0.1 * step
    return row


@flow(name="fake-step")
def fake_step(storage: RunStorage, step: int) -> None:
    metrics = fake_metrics(step)
    storage.write_metrics(step, metrics)
    publish_step_metrics(storage.run, step, metrics)


@flow(name="fake-run")
def fake_run(root: str, run: str) -> None:
    """The run flow's hooks around fake steps that write metrics to storage: the progress, the
    live views (as ``rl_run`` calls them: after each commit, closed at the end), the summary."""
    storage = RunStorage(root, run)
    storage.write_metrics(0, {"eval_reward": 0.2})
    progress = RunProgress(storage.run, NUM_STEPS, 0)
    # Unpaced (share 1): these steps take milliseconds, a real one longer than a redraw.
    live = LiveViews(storage, NUM_STEPS, UI_EVERY, progress, share=1.0)
    for step in range(1, NUM_STEPS + 1):
        fake_step(storage, step)
        storage.commit("checkpoints", step)
        progress.update(step)
        live.committed(step)
        if step % UI_EVERY == 0:  # a real step takes longer than a redraw: let it finish
            deadline = time.monotonic() + 60
            while step not in live.drawn and time.monotonic() < deadline:
                time.sleep(0.05)
    live.close()
    storage.append_event("training_finished", step=NUM_STEPS)
    publish_summary(storage)


def test_run_publishes_step_tables_progress_and_summary(prefect_api, tmp_path):
    suffix = uuid.uuid4().hex[:8]  # the tests' Prefect database outlives a session
    run = f"Fake_Run.{suffix}"
    fake_run(str(tmp_path), run)
    assert artifact_key(run, "summary") == f"fake-run-{suffix}-summary"

    tables = read_artifacts(f"fake-run-{suffix}-step-metrics")
    assert [a.description for a in tables] == [
        f"Metrics of step {s} of run {run}" for s in range(1, 5)
    ]
    assert all(a.type == "table" and a.flow_run_id is not None for a in tables)
    assert len({a.flow_run_id for a in tables}) == NUM_STEPS  # one per step flow run
    rows = {r["metric"]: r["value"] for r in json.loads(tables[-1].data)}
    assert rows["reward_mean"] == pytest.approx(0.4) and rows["num_groups_kept"] == 8
    assert rows["loss"] is None  # NaN is shown empty, not as an invalid number

    (progress,) = read_artifacts(f"fake-run-{suffix}-progress")
    assert progress.type == "progress" and float(progress.data) == 100.0
    # The pace, from the committed steps' step_s (1.5 s each); no ETA once all are committed.
    assert progress.description == f"Run {run}: 4 of 4 steps committed; 40 steps/min"

    # The live views: redrawn during the run at steps 2 and 4 (UI_EVERY), one key each, on the
    # run's flow run; the end adds no third version (step 4 was drawn).
    curves = read_artifacts(f"fake-run-{suffix}-curves")
    assert [a.description for a in curves] == [
        f"Curves of run {run} to committed step {s} of 4" for s in (2, 4)
    ]
    run_flow = read_artifacts(f"fake-run-{suffix}-summary")[0].flow_run_id
    assert all(a.type == "markdown" and a.flow_run_id == run_flow for a in curves)
    assert curves[0].created < tables[-1].created  # drawn before the last step's table: live
    assert f"# Run `{run}`: step 2 of 4" in curves[0].data
    png = base64.b64decode(
        re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", curves[-1].data).group(1)
    )
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 150_000
    envs = read_artifacts(f"fake-run-{suffix}-envs")
    assert [a.description for a in envs] == [
        f"Each environment of run {run} to committed step {s}" for s in (2, 4)
    ]
    assert all(a.type == "table" and a.flow_run_id == run_flow for a in envs)
    by_env = {r["env"]: r for r in json.loads(envs[-1].data)}
    assert set(by_env) == {"add", "sort_letters"}
    assert by_env["add"]["rollouts"] == 64 and by_env["add"]["reward (last step)"] == 0.2
    assert by_env["sort_letters"]["steps sampled"] == 4

    (summary,) = read_artifacts(f"fake-run-{suffix}-summary")
    text = summary.data
    assert summary.type == "markdown"
    assert "4 steps committed (last: 4), training finished" in text
    assert "| first | 0 | 0.200 |" in text and "| last | 4 | 0.600 |" in text
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", text).group(1))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    run_uri = f"{tmp_path}/{run}"
    for part in ("rollouts", "batches", "metrics", "checkpoints", "events.jsonl"):
        assert f"[{run_uri}/{part}](file://{run_uri}/{part})" in text


def test_progress_counts_a_resumed_run_from_its_committed_steps(prefect_api):
    run = f"resumed-{uuid.uuid4().hex[:8]}"

    @flow(name="resumed-run")
    def resumed() -> None:
        progress = RunProgress(run, 10, done=6)
        progress.update(7)
        progress.update(5)  # steps commit in order: a lower step changes nothing

    resumed()
    (art,) = read_artifacts(f"{run}-progress")
    assert float(art.data) == 70.0


def test_a_failure_to_publish_is_a_warning_never_an_error(prefect_api, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise ConnectionError("API unreachable")

    for name in ("create_table_artifact", "create_progress_artifact", "create_markdown_artifact"):
        monkeypatch.setattr(artifacts, name, refuse)
        monkeypatch.setattr(live_views, name, refuse, raising=False)

    @flow(name="step-with-broken-artifacts")
    def step() -> str:
        publish_step_metrics("broken", 1, {"reward_mean": 1.0})
        progress = RunProgress("broken", 3)
        progress.update(1)  # nothing to update: no artifact was created
        publish_summary(RunStorage("/nonexistent-root", "broken"))
        LiveViews(RunStorage("/nonexistent-root", "broken"), 3, 1, progress).close()
        return "step finished"

    with caplog.at_level(logging.WARNING):
        assert step() == "step finished"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "could not publish the publish_step_metrics artifact: ConnectionError" in w
        for w in warnings
    )
    assert any("could not publish the _create artifact" in w for w in warnings)
    assert any("could not publish the publish_summary artifact" in w for w in warnings)
    assert any("could not publish the _publish_curves artifact" in w for w in warnings)
