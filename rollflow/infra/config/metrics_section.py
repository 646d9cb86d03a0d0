"""``[metrics]``: where each step's metrics row goes besides storage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollflow.infra.config.base import Section


class WandbOptions(Section):
    """Weights & Biases sink (used when metrics.sinks names "wandb")."""

    project: str = Field("rollflow", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); None: your default.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="offline writes under the run's log dir; upload later with `wandb sync`.",
    )


class MlflowOptions(Section):
    """MLflow sink (used when metrics.sinks names "mlflow")."""

    tracking_uri: str | None = Field(
        None, description="e.g. http://host:5000 or sqlite:///mlflow.db; None: MLFLOW_TRACKING_URI."
    )
    experiment: str = Field("rollflow", description="MLflow experiment; created if missing.")


class MetricsSection(Section):
    """Where each step's metrics row goes besides storage (metrics/step=N.parquet)."""

    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="Metric sinks; [] for storage only."
    )
    tensorboard_dir: str | None = Field(
        None, description="TensorBoard event folder; None: <the run's log dir>/tensorboard."
    )
    wandb: WandbOptions = Field(
        default_factory=WandbOptions, description="[metrics.wandb]: options of the W&B sink."
    )
    mlflow: MlflowOptions = Field(
        default_factory=MlflowOptions, description="[metrics.mlflow]: options of the MLflow sink."
    )
    ui_every: int = Field(
        5,
        ge=0,
        description="Redraw the run's live views in the Prefect UI (the curves plot, the "
        "per-environment table, the progress artifact's pace and ETA) every N committed steps "
        "and at the end, from the committed metrics, paced to at most 5% of the run's time; 0: "
        "at the end only.",
    )

    @model_validator(mode="after")
    def _unique_sinks(self) -> MetricsSection:
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"metrics.sinks repeats a sink: {self.sinks}; name each once")
        return self
