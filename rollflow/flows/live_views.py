"""The run's live views in the Prefect UI, redrawn during the run from its committed metrics.

- ``<run>-curves``: a markdown artifact holding one PNG (matplotlib, a data URI) of six panels:
  reward (sampled, per environment when several, and held-out), loss, KL, entropy, completion
  lengths and staleness, by step;
- ``<run>-envs``: a table artifact, one row per environment: rollouts, sampled reward (last
  step and its mean over the last steps), held-out reward (first and last);
- the progress artifact (``artifacts.RunProgress``) gets the pace, steps per minute over the last
  committed steps, and an ETA.

They are redrawn every ``metrics.ui_every`` committed steps and at the end, paced so that
redrawing takes at most ``REDRAW_SHARE`` of the run's time: after a redraw of d seconds the next
waits until d / REDRAW_SHARE after the last began (redraws falling due meanwhile coalesce into
one, of the newest committed step). Prefect keeps one version per redraw under the same key; the
Artifacts page and the flow run's Artifacts tab show the latest.

Owns: what the views show. Invariant: every figure is read from storage, the metrics rows of
committed steps only (``rollflow.runs.CommittedMetrics``, the rule ``rollflow.open_run`` reads
by; each file read once where it cannot change), never from the run's memory; so a resumed run's
views hold all of it, and a step in flight is never drawn. A redraw runs on a thread of its own,
off the step loop; one that fails is a warning, never a failed run.

Why paced: on 2 cores a redraw of the quickstart's model at step 100 took ~1 s of CPU (drawing
the PNG 0.5-0.8 s, and before the rows were kept, reading 100 Parquet files 0.24-0.39 s), every 5
steps of ~1.2 s: 17% of a core that the run's vLLM and trainer wanted (docs/performance.md).
"""

from __future__ import annotations

import base64
import contextvars
import io
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from rollflow.flows.artifacts import RunProgress, _best_effort, _cell, _run_logger, artifact_key
from rollflow.infra.metric_names import Metric, by_env, is_number, per_env, series
from rollflow.infra.storage import RunStorage
from rollflow.runs import CommittedMetrics

logger = logging.getLogger("rollflow.artifacts")

PACE_WINDOW = 10  # steps per minute: over the last N committed steps
REDRAW_SHARE = 0.05  # at most this share of the run's wall time goes to redrawing (paced)
CLOSE_DEADLINE_S = 60.0  # the last redraw at the end of a run; a failed run waits 5 s at most
FIGSIZE, DPI = (9.0, 6.0), 72  # 648 x 432 px: ~40-60 kB of PNG per redraw

Series = list[tuple[int, float]]


@dataclass
class Snapshot:
    """What one redraw shows, all of it from the committed metrics rows ``rows``."""

    rows: list[dict[str, Any]]
    panels: dict[str, dict[str, Series]]  # panel title -> line label -> (step, value)
    envs: list[dict[str, Any]]  # the per-environment table
    last_step: int  # the last committed step drawn (0: none yet)
    steps_per_min: float | None  # over the last PACE_WINDOW committed steps


def snapshot(storage: RunStorage, metrics: CommittedMetrics | None = None) -> Snapshot:
    """Read the run's committed metrics (through ``metrics``, which keeps the rows that cannot
    change, where a caller redraws again and again) and build every figure of the views."""
    rows = sorted((metrics or CommittedMetrics(storage)).read(), key=lambda r: r[Metric.STEP])
    steps = [r for r in rows if r[Metric.STEP] > 0]
    return Snapshot(
        rows=rows,
        panels=panels(rows),
        envs=env_rows(rows),
        last_step=steps[-1][Metric.STEP] if steps else 0,
        steps_per_min=steps_per_minute(steps),
    )


def panels(rows: list[dict[str, Any]]) -> dict[str, dict[str, Series]]:
    """The plot's panels: title -> {line label: [(step, value)]} (a line without a point is
    left out; a panel without a line says so on the plot)."""
    envs = sorted({env for r in rows for env in by_env(r, Metric.REWARD)})
    reward = {"sampled": series(rows, Metric.REWARD_MEAN)}
    if len(envs) > 1:
        reward |= {f"sampled {e}": series(rows, per_env(Metric.REWARD, e)) for e in envs}
    reward["held-out"] = series(rows, Metric.EVAL_REWARD)
    eval_envs = sorted({env for r in rows for env in by_env(r, Metric.EVAL_REWARD)})
    if len(eval_envs) > 1:
        reward |= {f"held-out {e}": series(rows, per_env(Metric.EVAL_REWARD, e)) for e in eval_envs}
    out = {
        "reward": reward,
        "loss": {"loss": series(rows, Metric.LOSS)},
        "KL": {
            "to the reference": series(rows, Metric.KL),
            "trainer vs vLLM": series(rows, Metric.MISMATCH_KL),
        },
        "entropy": {"entropy": series(rows, Metric.ENTROPY)},
        "completion tokens": {
            "mean": series(rows, Metric.COMPLETION_TOKENS_MEAN),
            "max": series(rows, Metric.COMPLETION_TOKENS_MAX),
        },
        "staleness (steps)": {
            "mean": series(rows, Metric.STALENESS_MEAN),
            "max": series(rows, Metric.STALENESS_MAX),
        },
    }
    return {title: {k: v for k, v in lines.items() if v} for title, lines in out.items()}


def env_rows(rows: list[dict[str, Any]], recent: int = PACE_WINDOW) -> list[dict[str, Any]]:
    """One row per environment: its rollouts over the committed steps, its sampled reward at the
    last step that sampled it and averaged over its last ``recent`` steps, its held-out reward
    at the first and last evaluation."""
    names = sorted(
        {env for r in rows for key in (Metric.REWARD, Metric.EVAL_REWARD) for env in by_env(r, key)}
    )
    out = []
    for env in names:
        sampled = series(rows, per_env(Metric.REWARD, env))
        held_out = series(rows, per_env(Metric.EVAL_REWARD, env))
        counts = series(rows, per_env(Metric.NUM_ROLLOUTS, env))
        last = [v for _, v in sampled[-recent:]]
        out.append(
            {
                "env": env,
                "rollouts": int(sum(v for _, v in counts)) if counts else None,
                "steps sampled": len(sampled),
                "reward (last step)": _cell(sampled[-1][1]) if sampled else None,
                f"reward (mean of last {recent} steps)": (
                    _cell(sum(last) / len(last)) if last else None
                ),
                "held-out (first)": _cell(held_out[0][1]) if held_out else None,
                "held-out (last)": _cell(held_out[-1][1]) if held_out else None,
                "held-out at step": held_out[-1][0] if held_out else None,
            }
        )
    return out


def steps_per_minute(steps: list[dict[str, Any]], window: int = PACE_WINDOW) -> float | None:
    """Committed steps per minute over the last ``window`` committed steps, from each step's
    share of the run's wall clock (``step_s``); None before any."""
    recent = [r[Metric.STEP_S] for r in steps[-window:] if is_number(r.get(Metric.STEP_S))]
    total = sum(recent)
    return 60.0 * len(recent) / total if recent and total > 0 else None


def curves_png(snap: Snapshot) -> bytes:
    """The panels as one small PNG (matplotlib's Figure: no pyplot, safe off the main thread)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    axes = fig.subplots(2, 3, sharex=True).flat
    for ax, (title, lines) in zip(axes, snap.panels.items(), strict=True):
        ax.set_title(title, fontsize="medium")
        for label, points in lines.items():
            held_out = label.startswith("held-out")
            style = dict(marker="o", markersize=3) if held_out else {}
            ax.plot(*zip(*points, strict=True), label=label, linewidth=1.2, **style)
        if not lines:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        elif len(lines) > 1:
            ax.legend(fontsize="x-small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize="small")
    for ax in list(fig.axes)[3:]:
        ax.set_xlabel("step", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def curves_markdown(run: str, snap: Snapshot, num_steps: int) -> str:
    png = base64.b64encode(curves_png(snap)).decode()
    return "\n".join(
        [
            f"# Run `{run}`: step {snap.last_step} of {num_steps}",
            "",
            f"![curves of run {run} to step {snap.last_step}](data:image/png;base64,{png})",
            "",
            "From the metrics of the committed steps (`metrics/step=N.parquet`). Reward: the mean "
            "of the step's sampled rollouts; held-out: the evaluation on fixed prompts (step 0: "
            "before training). KL: to the reference policy (0 without one), and of the trainer's "
            "log-probabilities to vLLM's. Completion tokens: the model's, per rollout.",
        ]
    )


def eta_text(snap: Snapshot, num_steps: int) -> str:
    """``3.2 steps/min, ETA 12 min`` (empty before a committed step has a duration)."""
    rate = snap.steps_per_min
    if not rate:
        return ""
    left = max(0, num_steps - snap.last_step)
    return (
        f"{rate:.3g} steps/min, ETA {_duration(60.0 * left / rate)}"
        if left
        else (f"{rate:.3g} steps/min")
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"


class LiveViews:
    """Redraws the run's views every ``every`` committed steps (0: only at ``close``) and at the
    end, on a thread of its own that runs in the run flow's context (the artifacts belong to its
    flow run). Redraws take at most ``share`` of the time (``REDRAW_SHARE``; 1: unpaced); those
    that fall due while one runs or waits coalesce into one."""

    def __init__(
        self,
        storage: RunStorage,
        num_steps: int,
        every: int,
        progress: RunProgress | None = None,
        publish: Callable[[Snapshot], None] | None = None,
        share: float = REDRAW_SHARE,
    ):
        self.storage, self.num_steps, self.every, self.progress = (
            storage,
            num_steps,
            every,
            progress,
        )
        self.publish = publish or self._publish
        self.share = share
        self.drawn: list[int] = []  # the last step of each redraw published, in order
        self._metrics = CommittedMetrics(storage)
        self._next_at = 0.0  # time.monotonic() before which no redraw starts (the pacing)
        self._due, self._closing, self._final = threading.Event(), False, True
        self._closed = threading.Event()  # ends the pacing's wait
        self._context = contextvars.copy_context()
        self._thread: threading.Thread | None = None

    def committed(self, step: int) -> None:
        """Step ``step`` committed: redraw when a multiple of ``every``."""
        if self.every and step % self.every == 0:
            self._wake()

    def close(self, final: bool = True) -> None:
        """Stop: first redraw with all that is committed (``final``), within CLOSE_DEADLINE_S (a
        failed run stops within 5 s and does not redraw)."""
        self._closing, self._final = True, final
        self._closed.set()
        if final:
            self._wake()
        elif self._thread is None:
            return
        self._due.set()
        self._thread.join(CLOSE_DEADLINE_S if final else 5.0)
        if self._thread.is_alive():
            _run_logger().warning(
                "the live views' last redraw did not end within %.0f s; the run goes on without it",
                CLOSE_DEADLINE_S if final else 5.0,
            )

    def refresh(self) -> Snapshot | None:
        """Redraw now, on this thread (a failure is a warning and returns None)."""
        try:
            snap = snapshot(self.storage, self._metrics)
        except Exception as exc:  # storage unreachable for a moment: the next redraw retries
            _run_logger().warning(
                "could not read the committed metrics for the live views: %s: %s",
                type(exc).__name__,
                exc,
            )
            return None
        self.publish(snap)
        self.drawn.append(snap.last_step)
        return snap

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._context.run, args=(self._loop,), name="live-views", daemon=True
            )
            self._thread.start()
        self._due.set()

    def _loop(self) -> None:
        while True:
            self._due.wait()
            self._closed.wait(max(0.0, self._next_at - time.monotonic()))  # paced; not at the end
            self._due.clear()
            closing = self._closing
            if not closing or self._final_due():
                start = time.monotonic()
                self.refresh()
                self._next_at = start + (time.monotonic() - start) / self.share
            if closing:
                return

    def _final_due(self) -> bool:
        return self._final and (not self.drawn or self.drawn[-1] < self._committed_last())

    def _committed_last(self) -> int:
        from rollflow.runs import committed_steps

        try:
            steps = committed_steps(self.storage)
        except Exception:
            return math.inf  # unknown: redraw
        return steps[-1] if steps else 0

    def _publish(self, snap: Snapshot) -> None:
        run = self.storage.run
        if self.progress is not None:
            self.progress.set_pace(eta_text(snap, self.num_steps))
        _publish_curves(run, snap, self.num_steps)
        _publish_envs(run, snap)


@_best_effort
def _publish_curves(run: str, snap: Snapshot, num_steps: int) -> None:
    create_markdown_artifact(
        curves_markdown(run, snap, num_steps),
        key=artifact_key(run, "curves"),
        description=f"Curves of run {run} to committed step {snap.last_step} of {num_steps}",
    )


@_best_effort
def _publish_envs(run: str, snap: Snapshot) -> None:
    if snap.envs:
        create_table_artifact(
            snap.envs,
            key=artifact_key(run, "envs"),
            description=f"Each environment of run {run} to committed step {snap.last_step}",
        )
