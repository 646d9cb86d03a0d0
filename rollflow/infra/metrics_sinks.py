"""Metric sinks behind one interface: TensorBoard (default), Weights & Biases, MLflow.

Storage holds the record of every step (``metrics/step=N.parquet``); sinks are views of it for
people. The run hands each step's metrics row to ``MetricSinks.log(step, metrics)``::

    with MetricSinks.from_config(cfg, log_dir) as sinks:
        storage.write_metrics(step, metrics)
        sinks.log(step, metrics)

TensorBoard writes event files under the run's log dir. W&B and MLflow are imported only when
configured; a configured sink whose package is missing is an error that says what to install.
A resumed run continues the same W&B run and the same MLflow run (both keyed by the run's
storage URI), so one run is one curve however often it restarts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollflow.infra.config import ConfigError, MlflowOptions, RunConfig, WandbOptions, dump_config

log = logging.getLogger(__name__)

# sink -> (module it imports, what to install)
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'rollflow[wandb]' (or: pip install wandb)"),
    "mlflow": ("mlflow", "pip install 'rollflow[mlflow]' (or: pip install mlflow-skinny)"),
}


def check_sinks_available(sinks: list[str]) -> None:
    """Fail before the run starts if a configured sink cannot be imported (no import happens)."""
    for sink in sinks:
        module, install = PACKAGES[sink]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"metrics.sinks has {sink!r} but the {module} package is not installed: {install}, "
                f"or remove {sink!r} from metrics.sinks"
            )


class MetricSink(ABC):
    """One destination of metric rows."""

    name: str

    @abstractmethod
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite numeric metrics of ``step``."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; called once at the end of the run."""


class TensorBoardSink(MetricSink):
    """Scalars as TensorBoard event files (``tensorboard --logdir <dir>``)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricSink):
    """A W&B run whose id is derived from the run's storage URI, resumed on restart."""

    name = "wandb"

    def __init__(
        self, opts: WandbOptions, run_name: str, run_uri: str, config: dict, log_dir: Path
    ):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=opts.project,
            entity=opts.entity,
            name=run_name,
            mode=opts.mode,
            id=stable_run_id(run_name, run_uri),
            resume="allow",
            dir=str(log_dir),
            config=config,
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # W&B drops a step lower than one it has seen (a step redone after a crash): it warns.
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink(MetricSink):
    """An MLflow run tagged with the run's storage URI, found again on restart."""

    name = "mlflow"
    TAG = "rollflow.run_uri"

    def __init__(self, opts: MlflowOptions, run_name: str, run_uri: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=opts.tracking_uri)
        experiment = self.client.get_experiment_by_name(opts.experiment)
        exp_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(opts.experiment)
        )
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`{self.TAG}` = '{run_uri}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                exp_id, run_name=run_name, tags={self.TAG: run_uri}
            ).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in sorted(_flatten(config).items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, step) for key, value in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class MetricSinks:
    """Every configured sink behind one ``log``.

    Invariant: a sink that fails while logging never fails the training step: the failure is
    reported once (a warning naming the sink, the step and the error), that sink is dropped for
    the rest of the run, and the step's row stays in storage.
    """

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)

    @classmethod
    def from_config(cls, cfg: RunConfig, log_dir: str | Path) -> MetricSinks:
        m = cfg.metrics
        check_sinks_available(m.sinks)
        log_dir = Path(log_dir).expanduser()
        run_uri = _run_uri(cfg)
        sinks: list[MetricSink] = []
        try:
            for name in m.sinks:
                if name == "tensorboard":
                    tb_dir = (
                        Path(m.tensorboard_dir).expanduser()
                        if m.tensorboard_dir
                        else log_dir / "tensorboard"
                    )
                    sinks.append(TensorBoardSink(tb_dir))
                elif name == "wandb":
                    sinks.append(
                        WandbSink(m.wandb, cfg.run.name, run_uri, dump_config(cfg), log_dir)
                    )
                elif name == "mlflow":
                    sinks.append(MlflowSink(m.mlflow, cfg.run.name, run_uri, dump_config(cfg)))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = numeric_scalars(metrics)
        for sink in list(self.sinks):
            try:
                sink.log(step, scalars)
            except Exception as exc:  # a metrics service outage must not stop training
                log.warning(
                    "metric sink %s failed at step %d (%s: %s); not logging to it for the rest "
                    "of this run (metrics stay in storage)",
                    sink.name,
                    step,
                    type(exc).__name__,
                    exc,
                )
                self.sinks.remove(sink)
                _close_quietly(sink)

    def close(self) -> None:
        for sink in self.sinks:
            _close_quietly(sink)
        self.sinks = []

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def numeric_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (bools as 0/1); None, NaN, text and dicts are left out."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool | int | float) and math.isfinite(value):
            out[key] = float(value)
    return out


def stable_run_id(run_name: str, run_uri: str) -> str:
    """A W&B run id (letters, digits, - and _) that is the same for every restart of one run."""
    digest = hashlib.sha256(run_uri.encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_name)[:50]}-{digest}"


def _run_uri(cfg: RunConfig) -> str:
    from rollflow.infra.storage import RunStorage

    return RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options).uri


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _close_quietly(sink: MetricSink) -> None:
    try:
        sink.close()
    except Exception as exc:
        log.warning("metric sink %s failed to close: %s: %s", sink.name, type(exc).__name__, exc)
