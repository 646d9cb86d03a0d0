"""The run's end shows its curve: a held-out sparkline as the terminal's last line, and
curve.png beside the run, both read from the committed metrics."""

from rollflow.flows.curve import BARS, MAX_BARS, curve_line, sparkline
from rollflow.flows.rl_run import summarize
from rollflow.infra.metric_names import Metric
from rollflow.infra.storage import RunStorage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sparkline_draws_the_series_from_its_lowest_to_its_highest():
    assert sparkline([0.82, 0.84, 0.90, 0.94]) == "▁▂▆█"
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    # a flat curve stays flat: differences below MIN_SPAN are not blown up to the full height
    assert sparkline([0.50, 0.51, 0.52]) == "▃▅▆"
    assert sparkline([0.7, 0.7]) == "▅▅"
    assert sparkline([]) == ""


def test_curve_line_names_first_last_and_steps():
    line = curve_line([(0, 0.47), (10, 0.71), (20, 0.9)])
    assert line == "held-out reward ▁▅█ 0.47 → 0.90 over steps 0–20"


def test_a_long_series_is_averaged_to_fit_a_line():
    line = curve_line([(s, s / 999) for s in range(1000)], "sampled reward")
    bars = line.split()[2]
    assert len(bars) == MAX_BARS and set(bars) <= set(BARS)
    assert bars[0] == BARS[0] and bars[-1] == BARS[-1]


def test_summarize_ends_with_the_curve_and_writes_the_plot(tmp_path):
    storage = RunStorage(str(tmp_path), "r")
    storage.write_metrics(0, {Metric.EVAL_REWARD: 0.45})
    for step, reward in enumerate([0.4, 0.6, 0.7, 0.8], start=1):
        row = {Metric.REWARD_MEAN: reward}
        if step % 2 == 0:
            row[Metric.EVAL_REWARD] = 0.45 + 0.2 * step / 2
        storage.write_metrics(step, row)
    lines: list[str] = []

    summary = summarize(storage, lines.append)

    plot = tmp_path / "r" / "curve.png"
    assert summary["curve"] == str(plot)
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert lines[-4].startswith("done: held-out reward 0.450 (step 0) -> 0.850 (step 4)")
    assert lines[-3] == f"plot: {plot}"
    assert lines[-2] == "sampled reward  ▁▄▆█ 0.40 → 0.80 over steps 1–4"
    assert lines[-1] == "held-out reward ▁▄█ 0.45 → 0.85 over steps 0–4"


def test_a_run_without_steps_shows_no_curve(tmp_path):
    lines: list[str] = []
    summary = summarize(RunStorage(str(tmp_path), "r"), lines.append)
    assert summary["curve"] is None and lines == []
    assert not (tmp_path / "r" / "curve.png").exists()
