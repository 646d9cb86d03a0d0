"""Metric sinks, read back from what each one wrote (TensorBoard events, a W&B offline run file,
an MLflow file store)."""

import glob
import json
import logging
import math
import struct
import sys

import pytest

from rollflow.infra.config import load_config
from rollflow.infra.metrics_sinks import (
    ConfigError,
    MetricSink,
    MetricSinks,
    TensorBoardSink,
)

QUICKSTART = "configs/quickstart.toml"
STEP1 = {
    "reward_mean": 0.25,
    "num_errors": 3,
    "rollouts_reused": False,
    "loss": math.nan,
    "sync_s": None,
    "retry_reasons": {"RequestAborted": 2},
    "note": "text",
}


def config(tmp_path, *overrides):
    return load_config(QUICKSTART, [f"run.storage='{tmp_path / 'runs'}'", *overrides])


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_is_the_default_and_writes_the_numeric_metrics(tmp_path):
    cfg = config(tmp_path)
    assert cfg.metrics.sinks == ["tensorboard"]
    with MetricSinks.from_config(cfg, tmp_path / "logs") as sinks:
        sinks.log(0, {"eval_reward": 0.5, "eval_reward/add": 0.75})
        sinks.log(1, STEP1)
    scalars = tensorboard_scalars(tmp_path / "logs" / "tensorboard")
    assert scalars == {
        "eval_reward": [(0, 0.5)],
        "eval_reward/add": [(0, 0.75)],
        "reward_mean": [(1, 0.25)],
        "num_errors": [(1, 3.0)],
        "rollouts_reused": [(1, 0.0)],
    }


def test_a_failing_sink_is_dropped_with_a_warning_and_the_others_go_on(tmp_path, caplog):
    class Broken(MetricSink):
        name = "broken"
        closed = False

        def log(self, step, scalars):
            raise ConnectionError("service down")

        def close(self):
            Broken.closed = True

    sinks = MetricSinks([Broken(), TensorBoardSink(tmp_path / "tb")])
    with caplog.at_level(logging.WARNING, logger="rollflow.infra.metrics_sinks"):
        sinks.log(1, {"reward_mean": 0.125})
        sinks.log(2, {"reward_mean": 0.25})
    sinks.close()
    assert (
        caplog.text.count("metric sink broken failed at step 1 (ConnectionError: service down)")
        == 1
    )
    assert Broken.closed and tensorboard_scalars(tmp_path / "tb") == {
        "reward_mean": [(1, 0.125), (2, 0.25)]
    }


@pytest.mark.parametrize(
    "sink, install",
    [("wandb", "pip install 'rollflow[wandb]'"), ("mlflow", "pip install 'rollflow[mlflow]'")],
)
def test_a_configured_sink_without_its_package_says_what_to_install(
    tmp_path, monkeypatch, sink, install
):
    monkeypatch.setitem(
        sys.modules, sink, None
    )  # what an environment without the package looks like
    cfg = config(tmp_path, f'metrics.sinks=["tensorboard", "{sink}"]')
    with pytest.raises(
        ConfigError,
        match=rf"metrics.sinks has '{sink}' but .* not installed: "
        rf"{install.replace('[', '.').replace(']', '.')}",
    ):
        MetricSinks.from_config(cfg, tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # nothing started before the error


def wandb_history(run_file) -> dict[int, dict[str, str]]:
    """History rows of a W&B offline run file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, pending = open(run_file, "rb").read(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, or middle / last
        if kind in (1, 4):
            records.append(pending)
    history = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): item.value_json
                for item in record.history.item
            }
            history[int(items.pop("_step"))] = {
                k: json.loads(v) for k, v in items.items() if not k.startswith("_")
            }
    return history


def test_wandb_offline_run_holds_the_steps_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, 'metrics.sinks=["wandb"]', "metrics.wandb.mode=offline")
    with MetricSinks.from_config(cfg, tmp_path / "logs") as sinks:
        sinks.log(1, STEP1)
    with MetricSinks.from_config(cfg, tmp_path / "logs") as sinks:  # a restart of the same run
        sinks.log(2, {"reward_mean": 0.5})
    import wandb

    wandb.teardown()  # wandb-core writes run files asynchronously; this waits until it is done
    run_files = glob.glob(str(tmp_path / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 2 and len({f.rsplit("/", 1)[1] for f in run_files}) == 1  # one run id
    history = {step: row for f in run_files for step, row in wandb_history(f).items()}
    assert history == {
        1: {"reward_mean": 0.25, "num_errors": 3, "rollouts_reused": 0},
        2: {"reward_mean": 0.5},
    }


def test_mlflow_run_holds_the_steps_and_the_config_and_resumes_the_same_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # MLflow's file store (deprecated, but 6 s faster to create than SQLite's schema migrations).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    cfg = config(
        tmp_path,
        'metrics.sinks=["mlflow"]',
        f"metrics.mlflow.tracking_uri='{uri}'",
        "metrics.mlflow.experiment=tests",
    )
    with MetricSinks.from_config(cfg, tmp_path / "logs") as sinks:
        sinks.log(1, STEP1)
    with MetricSinks.from_config(cfg, tmp_path / "logs") as sinks:
        sinks.log(2, {"reward_mean": 0.5})
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_name == "quickstart" and run.info.status == "FINISHED"
    assert [
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")
    ] == [(1, 0.25), (2, 0.5)]
    assert set(run.data.metrics) == {"reward_mean", "num_errors", "rollouts_reused"}
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["run.name"] == "quickstart"
