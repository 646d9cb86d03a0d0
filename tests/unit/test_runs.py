"""rollflow.open_run (rollflow/runs.py): a run's committed data, the same from a local folder and
from moto's S3 on 127.0.0.1; failures are one line; ``import rollflow`` stays cheap."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pyarrow as pa
import pytest

import rollflow
from rollflow.infra.errors import InputError, StorageError
from rollflow.infra.storage import RunStorage

pytestmark = pytest.mark.usefixtures("loopback_only")


def write_small_run(storage: RunStorage) -> None:
    """Steps 1 (checkpoint committed), 2 (``step_committed`` event only), 3 (metrics and
    rollouts, never committed) and a half-written rollouts folder of step 4."""
    storage.write_json("config.json", {"run": {"name": storage.run}})
    for step in (0, 1, 2, 3):
        row = {"reward_mean": step / 10, "loss": 1.0 - step / 10}
        if step in (0, 2):
            row["eval_reward"] = 0.5 + step / 10  # evaluation steps have more columns
        storage.write_metrics(step, row)
    for step in (1, 2, 3):
        rows = [{"step": step, "env": "add", "reward": float(i % 2)} for i in range(4)]
        storage.write_step_table("rollouts", step, pa.Table.from_pylist(rows))
    for kind, step in (("rollouts", 4), ("checkpoints", 1), ("checkpoints", 3)):
        storage.fs.makedirs(storage.step_dir(kind, step), exist_ok=True)
        storage.fs.pipe_file(f"{storage.step_dir(kind, step)}/part-0.parquet", b"torn")
    storage.commit("checkpoints", 1)  # step 3's checkpoint stays unmarked
    storage.append_event("run_started")
    storage.append_event("step_committed", step=2)


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path) -> tuple[str, dict]:
    """(storage, storage_options) of a run ``small`` written there."""
    if request.param == "local":
        root, options = str(tmp_path / "runs"), {}
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        root, options = f"s3://rollflow/api-{tmp_path.name}", {"endpoint_url": endpoint}
    write_small_run(RunStorage(root, "small", options))
    return root, options


def test_only_committed_steps_are_read(where):
    storage, options = where
    run = rollflow.open_run("small", storage=storage, storage_options=options)
    assert run.steps == [1, 2]
    metrics = run.metrics()
    assert metrics["step"].tolist() == [0, 1, 2]
    assert metrics["loss"].tolist() == pytest.approx([1.0, 0.9, 0.8])
    assert metrics["eval_reward"].isna().tolist() == [False, True, False]
    rollouts = run.rollouts(format="arrow")
    assert sorted(set(rollouts["step"].to_pylist())) == [1, 2] and rollouts.num_rows == 8
    assert run.rollouts(step=2)["reward"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert run.rollouts(step=3).empty  # sampled, but its step never committed
    assert run.metrics(format="polars").height == 3
    assert list(run.checkpoints()) == [1]
    assert run.checkpoints()[1].endswith("/small/checkpoints/step=1")
    assert [e["event"] for e in run.events()] == ["run_started", "step_committed"]
    assert run.config == {"run": {"name": "small"}}


def test_a_run_may_be_named_by_its_whole_address(where):
    storage, options = where
    run = rollflow.open_run(f"{storage}/small", storage_options=options)
    assert (run.name, run.steps) == ("small", [1, 2])


def test_a_run_in_progress_shows_new_commits_after_refresh(tmp_path):
    storage = RunStorage(str(tmp_path), "small")
    write_small_run(storage)
    run = rollflow.open_run("small", storage=str(tmp_path))
    assert run.steps == [1, 2]
    storage.commit("checkpoints", 3)
    assert run.steps == [1, 2] and run.refresh().steps == [1, 2, 3]
    assert run.metrics()["step"].tolist() == [0, 1, 2, 3]


def test_the_runs_config_gives_its_name_and_storage(tmp_path):
    write_small_run(RunStorage(str(tmp_path / "store"), "small"))
    config = tmp_path / "run.toml"
    config.write_text(
        f'[model]\npath = "unused"\n[[envs]]\nname = "add"\n'
        f'[run]\nname = "small"\nstorage = "{tmp_path / "store"}"\n'
    )
    assert rollflow.open_run(config=str(config)).steps == [1, 2]


def test_no_such_run_and_an_unreachable_endpoint_are_one_line(tmp_path):
    with pytest.raises(InputError, match="no run 'nothing' in"):
        rollflow.open_run("nothing", storage=str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    with pytest.raises(StorageError, match="unreachable|no answer") as caught:
        rollflow.open_run(
            "small", "s3://rollflow/x", storage_options={"endpoint_url": f"http://127.0.0.1:{port}"}
        )
    assert "\n" not in str(caught.value)


def test_import_rollflow_imports_no_torch_vllm_or_prefect():
    code = (
        "import json, sys, rollflow; rollflow.open_run; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not {"torch", "vllm", "prefect"} & set(json.loads(out.stdout))
