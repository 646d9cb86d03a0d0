"""notebooks/rollouts.ipynb runs, cell by cell, on a run the tests made (so it cannot rot): from
the run's folder, and from a copy of it in moto's S3 on 127.0.0.1 (the same run, no new one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOK = ROOT / "notebooks" / "rollouts.ipynb"


def test_every_table_and_plot_has_a_markdown_cell_that_says_what_it_shows():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    cells = nb.cells
    for i, cell in enumerate(cells):
        if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []):
            assert i > 0 and cells[i - 1].cell_type == "markdown", (
                f"code cell {i} has no explanation before it"
            )
            assert len(cells[i - 1].source.split()) >= 15, (
                f"markdown before code cell {i} says too little"
            )
    assert all(not c.get("outputs") for c in cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )


@pytest.fixture(params=["folder", "s3"])
def run_address(request, deployed_run) -> tuple[str, dict]:
    """The deployed run as the notebook is told of it: its folder, or a copy in moto's S3 of
    what the notebook reads (config, metrics, events, committed rollouts, checkpoint markers)."""
    run_dir = Path(deployed_run.run_dir)
    if request.param == "folder":
        return str(run_dir), {}
    import fsspec

    options = {"endpoint_url": request.getfixturevalue("s3_endpoint")}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    target = f"rollflow/notebook/{run_dir.name}"
    for local in sorted(run_dir.rglob("*")):
        relative = local.relative_to(run_dir).as_posix()
        wanted = relative.startswith(("metrics/", "rollouts/", "config.json", "events"))
        if local.is_file() and (wanted or relative.endswith("/_SUCCESS")):
            fs.pipe_file(f"{target}/{relative}", local.read_bytes())
    return f"s3://{target}", options


@pytest.mark.slow
def test_notebook_executes_on_a_run_made_by_the_tests(run_address, deployed_run, monkeypatch):
    run, options = run_address
    monkeypatch.setenv("ROLLFLOW_RUN", run)
    monkeypatch.setenv("ROLLFLOW_STORAGE_OPTIONS", json.dumps(options))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError, with the failing cell and traceback, if any cell fails.
    NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    outputs = {c.metadata["tags"][0]: c.outputs for c in nb.cells if c.cell_type == "code"}

    def text(tag: str) -> str:
        return "\n".join(
            o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs[tag]
        )

    def images(tag: str) -> int:
        return sum("image/png" in o.get("data", {}) for o in outputs[tag])

    assert (
        "quickstart: 2 committed steps (1..2), 64 completions, environments: sort_letters"
        in text("load")
    )
    table = text("reward-by-step")
    assert "shape: (2, 5)" in table and "│ 1    ┆ 32 " in table and "│ 2    ┆ 32 " in table
    assert "sort_letters ┆ 64" in text("reward-by-env")
    assert "shape: (2, 5)" in text("completion-lengths")
    # On-policy run: all fresh (versions are float64: whole steps print as 0.0).
    assert re.search(r"│ 0\.0\s+┆ 0\.0\s+┆ 64 ", text("staleness")), text("staleness")
    assert "shape: (12, 6)" in text("sample")
    # Single-turn episodes: one model turn each, nothing truncated at the episode limit.
    assert "shape: (2, 7)" in text("turns") and images("turns") == 1
    curves = text("training-curves")
    # Steps 0, 1, 2, and the curves the run has values of: reward, held-out reward and staleness
    # always; loss, both KLs, entropy and grad norm once a step trained. (A step whose groups all
    # lack signal trains nothing: the tiny run's sampled reward was 0.0 at both steps once.)
    recorded = _recorded_curves(Path(deployed_run.run_dir))
    assert {"reward_mean", "eval_reward", "staleness_mean"} <= recorded, recorded
    assert f"shape: (3, {1 + len(recorded)})" in curves, (recorded, curves)
    # (polars cuts the longer names in the header; "loss" is whole)
    assert ("loss" in curves) == ("loss" in recorded), (recorded, curves)
    assert [
        images(t)
        for t in (
            "reward-by-step",
            "reward-by-env",
            "training-curves",
            "completion-lengths",
            "staleness",
        )
    ] == [1, 1, 1, 1, 1]


# The notebook's training-curves columns (its PANELS).
CURVES = (
    "reward_mean",
    "eval_reward",
    "loss",
    "kl",
    "mismatch_kl",
    "entropy",
    "grad_norm",
    "staleness_mean",
)


def _recorded_curves(run_dir: Path) -> set[str]:
    """The training curves with a value at some step of the run's metrics."""
    import pyarrow.parquet as pq

    rows = [
        row
        for part in sorted((run_dir / "metrics").glob("step=*.parquet"))
        for row in pq.read_table(part).to_pylist()
    ]
    return {c for c in CURVES if any(r.get(c) is not None for r in rows)}
