"""The run's curve at its end, for a person at the terminal: the held-out reward drawn as a
sparkline (one bar per evaluation), and ``curve.png`` (sampled and held-out reward per step,
matplotlib) written beside the run, its path printed.

Both read the run's committed metrics (``RunStorage.read_metrics``), so a finished run rerun
shows the same curve.
"""

from __future__ import annotations

from typing import Any

from rollflow.flows.artifacts import reward_curve_png
from rollflow.infra.errors import StorageError
from rollflow.infra.metric_names import Metric, series
from rollflow.infra.storage import RunStorage

BARS = "▁▂▃▄▅▆▇█"
CURVE_FILE = "curve.png"
MAX_BARS = 60  # a longer series is averaged into this many bars, so that a line fits a terminal
MIN_SPAN = 0.05  # the smallest range of rewards drawn from ▁ to █


def sparkline(values: list[float], min_span: float = MIN_SPAN) -> str:
    """One bar per value, from the lowest (▁) to the highest (█), so that a rise of a few hundredths
    shows (the numbers beside it say how much). A series spanning less than ``min_span`` is drawn
    on that span around its middle: noise is not blown up into a curve."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < min_span:
        mid = (hi + lo) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    top = len(BARS) - 1
    return "".join(BARS[round((v - lo) / (hi - lo) * top)] for v in values)


def curve_line(evals: list[tuple[int, float]], what: str = "held-out reward") -> str:
    """``held-out reward ▄▆▇▇█ 0.47 → 0.90 over steps 0–40`` from (step, value) pairs."""
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    bars = sparkline(_averaged([v for _, v in evals], MAX_BARS))
    return f"{what} {bars} {first:.2f} → {last:.2f} over steps {first_step}–{last_step}"


def _averaged(values: list[float], width: int) -> list[float]:
    """``values`` as at most ``width`` means of consecutive runs of them (in order)."""
    if len(values) <= width:
        return values
    edges = [round(i * len(values) / width) for i in range(width + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:], strict=False)]


def show_curve(storage: RunStorage, rows: list[dict[str, Any]], out) -> str | None:
    """Write ``curve.png`` beside the run and say where, then draw the sampled reward per step
    and, last, the held-out reward per evaluation. Returns the plot's URI: None without a step,
    or where storage refused it (the curve is a view, never a reason to fail a finished run)."""
    uri = None
    png = reward_curve_png(rows)
    if png is not None:
        try:
            uri = storage.write_file(CURVE_FILE, png)
            out(f"plot: {uri}")
        except StorageError as exc:
            out(f"plot: not written ({exc})")
    sampled = series(rows, Metric.REWARD_MEAN)
    if len(sampled) > 1:
        out(curve_line(sampled, "sampled reward "))
    evals = series(rows, Metric.EVAL_REWARD)
    if evals:
        out(curve_line(evals))
    return uri
