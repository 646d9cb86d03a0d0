"""What a run shows in the Prefect UI: a metrics table per step, a progress bar, a summary.

- each step flow run publishes a table artifact of its metrics row (key ``<run>-step-metrics``,
  so the Artifacts page keeps one version per step);
- the run flow keeps a progress artifact (``<run>-progress``) at committed steps / ``num_steps``,
  with the pace and ETA the live views read (``live_views.py``, which also redraws the curves and
  the per-environment table during the run);
- at the end, a markdown summary (``<run>-summary``): held-out reward at start and end, the
  reward curve as an embedded PNG, and where the Parquet data, checkpoints and events are.

Invariant: publishing never fails a step. Storage is the record of a run; artifacts are a view of
it, so a failure to publish is logged as a warning and the step goes on.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from rollflow.infra.events import Event, has_event
from rollflow.infra.metric_names import Metric, by_env, is_number, per_env, series
from rollflow.infra.storage import RunStorage

logger = logging.getLogger("rollflow.artifacts")


def _best_effort(fn: Callable) -> Callable:
    """Run ``fn``; on any error log a warning (in the run's log when there is one) and return None."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # an artifact is never worth a failed step
            _run_logger().warning(
                "could not publish the %s artifact: %s: %s", fn.__name__, type(exc).__name__, exc
            )
            return None

    return wrapper


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logger


def artifact_key(run: str, kind: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run}-{kind}".lower()).strip("-")


# ------------------------------------------------------------------------------ step


@_best_effort
def publish_step_metrics(run: str, step: int, metrics: dict[str, Any]) -> UUID:
    """A two-column table (metric, value) of one step's metrics row."""
    rows = [{"metric": key, "value": _cell(value)} for key, value in metrics.items()]
    return create_table_artifact(
        rows,
        key=artifact_key(run, "step-metrics"),
        description=f"Metrics of step {step} of run {run}",
    )


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    return value if isinstance(value, int | str | bool) or value is None else str(value)


# ------------------------------------------------------------------------------ run


class RunProgress:
    """The run's progress artifact: committed steps over ``num_steps``, in percent; its
    description says the pace and ETA the live views last read (flows/live_views.py)."""

    def __init__(self, run: str, num_steps: int, done: int = 0):
        self.run, self.num_steps, self.done = run, num_steps, done
        self.pace = ""
        self._lock = threading.Lock()  # the step loop and the live views' thread both write
        self.artifact_id: UUID | None = self._create()

    @_best_effort
    def _create(self) -> UUID:
        return create_progress_artifact(
            self._percent(), key=artifact_key(self.run, "progress"), description=self._description()
        )

    def update(self, step: int) -> None:
        """Record that ``step`` committed (steps commit in order; a lower one changes nothing)."""
        self.done = max(self.done, step)
        if self.artifact_id is not None:
            self._update()

    def set_pace(self, pace: str) -> None:
        """Show ``pace`` (e.g. ``3.2 steps/min, ETA 12 min``) after the steps committed."""
        self.pace = pace
        if self.artifact_id is not None:
            self._update()

    @_best_effort
    def _update(self) -> None:
        with self._lock:  # each write carries the state at its time, in order
            update_progress_artifact(
                self.artifact_id, self._percent(), description=self._description()
            )

    def _percent(self) -> float:
        return 100.0 * min(self.done, self.num_steps) / self.num_steps

    def _description(self) -> str:
        text = f"Run {self.run}: {self.done} of {self.num_steps} steps committed"
        return f"{text}; {self.pace}" if self.pace else text


@_best_effort
def publish_summary(storage: RunStorage) -> UUID:
    """The run's markdown summary, built from storage alone (so a resumed run summarises it all)."""
    return create_markdown_artifact(
        summary_markdown(storage),
        key=artifact_key(storage.run, "summary"),
        description=f"Summary of run {storage.run}",
    )


def summary_markdown(storage: RunStorage) -> str:
    rows = storage.read_metrics()
    committed = storage.committed_steps("checkpoints")
    finished = has_event(storage, Event.TRAINING_FINISHED)
    evals = series(rows, Metric.EVAL_REWARD)
    lines = [
        f"# Run `{storage.run}`",
        "",
        f"{len(committed)} steps committed (last: {committed[-1] if committed else '-'})"
        f"{', training finished' if finished else ''}.",
        "",
    ]
    if evals:
        lines += [
            "| held-out reward | step | value |",
            "|---|---|---|",
            f"| first | {evals[0][0]} | {evals[0][1]:.3f} |",
            f"| last | {evals[-1][0]} | {evals[-1][1]:.3f} |",
            "",
        ]
    try:
        png = reward_curve_png(rows)
    except Exception as exc:  # no plotting library, or nothing to plot: the rest still helps
        _run_logger().warning("reward curve not rendered: %s: %s", type(exc).__name__, exc)
        png = None
    if png:
        lines += [
            "## Reward by step",
            "",
            f"![reward by step](data:image/png;base64,{base64.b64encode(png).decode()})",
            "",
        ]
    lines += ["## Data", "", "| what | where |", "|---|---|"]
    for what, part in (
        ("rollouts (Parquet, one folder per step)", "rollouts"),
        ("training batches (Parquet)", "batches"),
        ("metrics (Parquet, one file per step)", "metrics"),
        ("checkpoints (HF model folders)", "checkpoints"),
        ("events (JSON lines)", "events.jsonl" if storage.is_local else "events"),
    ):
        uri = f"{storage.uri}/{part}"
        lines.append(f"| {what} | [{uri}]({_link(uri)}) |")
    lines += [
        "",
        "Read them with DuckDB:",
        "",
        "```python",
        "import duckdb",
        f"duckdb.sql(\"select step, avg(reward) from '{storage.uri}/rollouts/*/*.parquet' "
        'group by step order by step")',
        "```",
        "",
        f"`rollflow status {storage.run} --storage {storage.root}` prints the step table; "
        f"`rollflow export {storage.run} --step N --storage {storage.root}` writes a HF model folder; "
        f"`notebooks/rollouts.ipynb` (with `ROLLFLOW_RUN={storage.uri}`) plots the rollouts.",
    ]
    return "\n".join(lines)


def reward_curve_png(rows: list[dict[str, Any]]) -> bytes | None:
    """Sampled reward per step (one line per environment when there are several) and held-out
    reward, as a small PNG; None when no step has a reward yet."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe off the main thread
    from matplotlib.ticker import MaxNLocator

    steps = [r for r in rows if is_number(r.get(Metric.REWARD_MEAN))]
    if not steps:
        return None
    fig = Figure(figsize=(6.4, 3.2), dpi=100)
    ax = fig.add_subplot()
    ax.plot(*zip(*series(steps, Metric.REWARD_MEAN), strict=True), label="sampled reward")
    envs = sorted({env for r in steps for env in by_env(r, Metric.REWARD)})
    if len(envs) > 1:
        for env in envs:
            points = series(steps, per_env(Metric.REWARD, env))
            ax.plot(*zip(*points, strict=True), linewidth=0.8, alpha=0.7, label=env)
    evals = series(rows, Metric.EVAL_REWARD)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _link(uri: str) -> str:
    return f"file://{uri}" if uri.startswith("/") else uri
