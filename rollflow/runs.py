"""Runs as data: a read-only view of a run's storage for notebooks and scripts.

    import rollflow
    run = rollflow.open_run("quickstart", storage="s3://bucket/rollflow",
                            storage_options={"endpoint_url": "http://127.0.0.1:9000"})
    run.metrics()                   # one row per committed step (step 0: the start), pandas
    run.rollouts(format="polars")   # every completion of the committed steps

Owns: which steps a reader sees. Invariant: every accessor reads committed steps only: a step
whose checkpoint folder holds ``_SUCCESS`` or whose ``step_committed`` event was recorded (the
commit rule of docs/concepts/step.md), and, for rollouts, a folder with its own ``_SUCCESS``.
A row of a step still in flight, or of a step a crash left half-written, is never returned.

The run is opened as ``rollflow status`` opens it (infra/storage_access.py): one probe under a
deadline, and each failure one ``InputError`` or ``StorageError`` line naming the setting to
change. Nothing here writes.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import pyarrow as pa

    from rollflow.infra.storage import RunStorage
    from rollflow.infra.storage_access import RunAddress

Format = Literal["pandas", "polars", "arrow"]


def open_run(
    run: str | None = None,
    storage: str | None = None,
    storage_options: dict[str, Any] | None = None,
    config: str | None = None,
) -> Run:
    """Open the run named ``run`` in ``storage`` (a folder or an ``s3://`` URI; default ``runs``).

    ``run`` may also be the run's whole address (``runs/quickstart``,
    ``s3://bucket/rollflow/quickstart``) when ``storage`` is not given. ``config`` (the run's
    TOML) gives the name, storage and options the run was started with; the arguments go over
    it. Credentials stay in the environment (or the config's Secret block), as for the CLI.
    Raises ``InputError`` (no such run) or ``StorageError`` (unreachable, refused), one line.
    """
    from rollflow.infra.storage_access import open_run as probe_and_open
    from rollflow.infra.storage_access import run_address

    if run and storage is None and config is None and "/" in run.rstrip("/"):
        storage, _, run = run.rstrip("/").rpartition("/")
    address = run_address(run, storage, [], config)
    address.options.update(storage_options or {})
    return Run(probe_and_open(address), address)


class Run:
    """One run's committed data, read on demand (nothing is cached but the committed steps)."""

    def __init__(self, storage: RunStorage, address: RunAddress):
        self.storage = storage
        self.address = address

    @property
    def name(self) -> str:
        return self.storage.run

    @property
    def uri(self) -> str:
        return self.storage.uri

    def __repr__(self) -> str:
        return f"Run({self.uri!r}, steps={self.steps})"

    @cached_property
    def steps(self) -> list[int]:
        """The committed steps, ascending (read once; ``refresh()`` reads them again)."""
        with self._errors():
            return committed_steps(self.storage)

    def refresh(self) -> Run:
        """Forget the committed steps read so far (a run in progress commits more)."""
        self.__dict__.pop("steps", None)
        return self

    @property
    def config(self) -> dict[str, Any] | None:
        """The run's resolved config (``config.json``, credentials already taken out)."""
        with self._errors():
            return self.storage.read_json("config.json")

    def events(self) -> list[dict[str, Any]]:
        """Every event the run recorded, in order (``event``, ``time`` and its fields)."""
        with self._errors():
            return self.storage.read_events()

    def checkpoints(self) -> dict[int, str]:
        """Each committed checkpoint's step and folder URI (a Hugging Face model folder)."""
        with self._errors():
            steps = self.storage.committed_steps("checkpoints")
        return {step: self.storage.step_uri("checkpoints", step) for step in steps}

    def metrics(self, format: Format = "pandas") -> Any:
        """One row per committed step, and step 0 (the start: held-out reward before training),
        ordered by step. Columns are the union over the rows (evaluation steps have more); a
        name is a ``rollflow.infra.metric_names.Metric``."""
        import pyarrow as pa

        with self._errors():
            rows = committed_metrics(self.storage, self.steps)
        columns = dict.fromkeys(key for row in rows for key in row)
        return _as(pa.table({key: [row.get(key) for row in rows] for key in columns}), format)

    def rollouts(self, step: int | None = None, format: Format = "pandas") -> Any:
        """Every sampled completion of the committed steps (or of ``step`` alone), read when
        asked; the columns are those of docs/concepts/rollout-record.md."""
        import pyarrow as pa

        steps = self.steps if step is None else [step]
        with self._errors():
            tables = [
                self.storage.read_step_table("rollouts", s)
                for s in steps
                if s in self.steps and self.storage.is_committed("rollouts", s)
            ]
        table = pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
        return _as(table, format)

    def _errors(self):
        from rollflow.infra.storage_access import storage_errors

        return storage_errors(self.address)


def committed_steps(storage: RunStorage, checkpointed: list[int] | None = None) -> list[int]:
    """The run's committed steps, ascending: a checkpoint folder with ``_SUCCESS`` (``checkpointed``
    where the caller has just listed them), or a ``step_committed`` event (the commit rule of
    docs/concepts/step.md)."""
    from rollflow.infra.events import Event

    done = set(storage.committed_steps("checkpoints") if checkpointed is None else checkpointed)
    done |= {
        int(e["step"])
        for e in storage.read_events()
        if e.get("event") == Event.STEP_COMMITTED and "step" in e
    }
    return sorted(done)


def committed_metrics(storage: RunStorage, steps: list[int] | None = None) -> list[dict[str, Any]]:
    """The metrics rows of the committed steps (``steps``, default: read now) and of step 0 (the
    start), by step. A row of a step in flight, or left half-done by a crash, is not among them.
    A reader that asks again and again (the run's live views) keeps a ``CommittedMetrics``."""
    committed = {0, *(committed_steps(storage) if steps is None else steps)}
    return [r for r in storage.read_metrics() if r.get("step") in committed]


class CommittedMetrics:
    """``committed_metrics`` read again and again during a run (its live views in the Prefect UI,
    flows/live_views.py), each metrics file read once where it cannot change.

    A step at or before the last committed checkpoint is never redone (docs/concepts/step.md), so
    its row is kept after the first read. A step committed by its event after that checkpoint
    (``run.checkpoint_every`` > 1) may be redone after a lost trainer, and step 0 is the start:
    those are read each time. Reading every file at every redraw made a redraw's cost grow with
    the run (0.24-0.39 s at 100 steps of the quickstart's model, one Parquet GET per step on an
    object store)."""

    def __init__(self, storage: RunStorage):
        self.storage = storage
        self._kept: dict[int, dict[str, Any]] = {}
        self.files_read = 0

    def read(self) -> list[dict[str, Any]]:
        """The rows of the committed steps and of step 0, by step."""
        checkpointed = self.storage.committed_steps("checkpoints")
        last_checkpoint = checkpointed[-1] if checkpointed else 0
        rows = []
        for step in sorted({0, *committed_steps(self.storage, checkpointed)}):
            row = self._kept.get(step)
            if row is None:
                row = self.storage.read_step_metrics(step)
                self.files_read += 1
                if row is not None and 0 < step <= last_checkpoint:
                    self._kept[step] = row
            if row is not None:
                rows.append(row)
        return rows


def _as(table: pa.Table, format: Format) -> Any:
    if format == "arrow":
        return table
    if format == "pandas":
        return table.to_pandas()
    if format == "polars":
        import polars as pl  # not a dependency of rollflow: the reader's own

        return pl.from_arrow(table)
    raise ValueError(f"format={format!r}: give 'pandas', 'polars' or 'arrow'")
