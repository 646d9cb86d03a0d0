"""The data plane: one run's files on fsspec storage (a local folder or ``s3://``).

Layout (see docs/architecture.md)::

    <root>/<run>/config.json
    <root>/<run>/rollouts/step=<N>/part-0.parquet + _SUCCESS
    <root>/<run>/batches/step=<N>/part-0.parquet  + _SUCCESS
    <root>/<run>/checkpoints/step=<N>/...         + _SUCCESS
    <root>/<run>/metrics/step=<N>.parquet
    <root>/<run>/events.jsonl                     (object stores: events/part-<N>.jsonl)

Invariant: a step directory counts only once its ``_SUCCESS`` marker exists, and the marker is
written after every other file of the directory. Readers never open an unmarked directory;
writers clear an unmarked directory before writing it again, so storage holds each step once.
The marker holds a commit id (unique per commit): a local copy of a step folder is valid only
while its marker holds the same id.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.infra.errors import StorageError
from rollflow.infra.faults import fault_point
from rollflow.infra.secrets import merge, secret_storage_options

SUCCESS = "_SUCCESS"
# Where a host keeps its local copies of committed step folders (``local_copy``): the trainer's
# ranks and nodes (checkpoints, the policy) and placed vLLM servers (the policy) alike.
LOCAL_CHECKPOINTS = Path("~/.cache/rollflow/checkpoints").expanduser()
_STEP_DIR = re.compile(r"step=(\d+)$")
_STEP_FILE = re.compile(r"step=(\d+)\.parquet$")
_SEGMENT = re.compile(r"part-(\d+)\.jsonl$")
_EVENTS_LOCK = threading.Lock()  # overlapping step flows append from several threads
EVENTS_PER_SEGMENT = 64
_SEGMENTS: dict[str, tuple[int, bytes, int]] = {}  # run URI -> (index, bytes, lines) of its segment


class RunStorage:
    """Reads and writes one run's files; knows which steps are committed."""

    def __init__(self, root: str, run: str, options: dict[str, Any] | None = None):
        protocol, _ = fsspec.core.split_protocol(root)
        if protocol in (None, "file"):
            root = str(Path(fsspec.core.strip_protocol(root)).expanduser().resolve())
        # Credentials handed over out of the config (infra/secrets.py), by the root as configured.
        self.options = merge(dict(options or {}), secret_storage_options(root))
        self.root = root.rstrip("/")
        self.run = run
        self.fs, self.base = fsspec.core.url_to_fs(f"{self.root}/{run}", **self.options)
        self.is_local = (
            self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol
        )

    # ------------------------------------------------------------------ paths

    @property
    def uri(self) -> str:
        return f"{self.root}/{self.run}"

    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def log_dir(self) -> Path:
        """Where the run's service logs go on this host: in the run's folder when storage is
        local, else under ~/.cache/rollflow/logs/RUN."""
        if self.is_local:
            return Path(self.path("logs"))
        return Path("~/.cache/rollflow/logs").expanduser() / self.run

    def step_dir(self, kind: str, step: int) -> str:
        return self.path(kind, f"step={step}")

    def step_uri(self, kind: str, step: int) -> str:
        return f"{self.uri}/{kind}/step={step}"

    # ------------------------------------------------------------ step folders

    def is_committed(self, kind: str, step: int) -> bool:
        return self.fs.exists(f"{self.step_dir(kind, step)}/{SUCCESS}")

    def committed_steps(self, kind: str) -> list[int]:
        """Steps of ``kind`` whose folder holds a ``_SUCCESS`` marker, ascending."""
        root = self.path(kind)
        try:
            markers = self.fs.glob(f"{root}/step=*/{SUCCESS}")
        except FileNotFoundError:
            return []
        steps = []
        for marker in markers:
            match = _STEP_DIR.search(marker.rsplit("/", 2)[-2])
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def clear_uncommitted(self, kind: str, step: int) -> bool:
        """Remove a half-written step folder; returns whether one was there."""
        folder = self.step_dir(kind, step)
        if self.fs.exists(folder) and not self.is_committed(kind, step):
            self.fs.rm(folder, recursive=True)
            return True
        return False

    def remove_step(self, kind: str, step: int) -> None:
        """Remove a step folder, marker first so no reader sees it half-removed."""
        folder = self.step_dir(kind, step)
        marker = f"{folder}/{SUCCESS}"
        if self.fs.exists(marker):
            self.fs.rm(marker)
        if self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)

    def keep_last(self, kind: str, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
        """Remove the committed ``kind`` steps older than the last ``keep`` (at least 1, so the
        latest stays), except those in ``protect``; returns the removed steps. Each goes marker
        first (``remove_step``): a removal cut short leaves a folder that no longer counts."""
        steps = self.committed_steps(kind)
        kept = set(steps[-max(1, keep) :]) | set(protect)
        removed = [step for step in steps if step not in kept]
        for step in removed:
            self.remove_step(kind, step)
        return removed

    def write_step_table(self, kind: str, step: int, table: pa.Table) -> str:
        """Write one step's table and commit it; returns the step folder's URI."""
        self.clear_uncommitted(kind, step)
        if self.is_committed(kind, step):
            raise StorageError(
                f"{self.step_uri(kind, step)} is already committed; refusing to overwrite"
            )
        folder = self.step_dir(kind, step)
        self.fs.makedirs(folder, exist_ok=True)
        self._write_bytes(f"{folder}/part-0.parquet", _parquet_bytes(table))
        self.commit(kind, step)
        return self.step_uri(kind, step)

    def commit(self, kind: str, step: int) -> None:
        """Write the ``_SUCCESS`` marker, holding a fresh commit id: the last write of a step folder."""
        self._write_bytes(
            f"{self.step_dir(kind, step)}/{SUCCESS}", f"{uuid.uuid4().hex}\n".encode()
        )

    def read_step_table(self, kind: str, step: int) -> pa.Table:
        """Read a committed step folder; an unmarked folder is an error."""
        if not self.is_committed(kind, step):
            raise StorageError(f"{self.step_uri(kind, step)} is not committed (no {SUCCESS})")
        parts = sorted(self.fs.glob(f"{self.step_dir(kind, step)}/part-*.parquet"))
        tables = [self._read_parquet(part) for part in parts]
        return pa.concat_tables(tables) if tables else pa.table({})

    def _read_parquet(self, path: str) -> pa.Table:
        """One Parquet file, copied whole into memory that Arrow owns, then decoded on this thread.

        Handed a Python object (a file, or bytes), Arrow's reader threads hold Python buffers, and
        one still releasing its buffer at interpreter exit aborts the process ("terminate called
        without an active exception": 1 in ~20 runs of ``rollflow status``, measured)."""
        data = self.fs.cat_file(path)
        owned = pa.allocate_buffer(len(data))
        memoryview(owned).cast("B")[:] = data
        with pq.ParquetFile(pa.BufferReader(owned)) as parquet:
            return parquet.read(use_threads=False)

    # ----------------------------------------------------------------- metrics

    def write_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"run": self.run, "step": step, **metrics}
        self._write_bytes(
            self.path("metrics", f"step={step}.parquet"),
            _parquet_bytes(pa.Table.from_pylist([row])),
        )

    def read_step_metrics(self, step: int) -> dict[str, Any] | None:
        """One step's metrics row (None where the step wrote none)."""
        try:
            rows = self._read_parquet(self.path("metrics", f"step={step}.parquet")).to_pylist()
        except FileNotFoundError:
            return None
        return rows[0] if rows else None

    def metric_steps(self) -> list[int]:
        """The steps that wrote a metrics row (each step does, before it commits), ascending."""
        try:
            files = self.fs.glob(self.path("metrics", "step=*.parquet"))
        except FileNotFoundError:
            return []
        return sorted(int(_STEP_FILE.search(f).group(1)) for f in files)

    def read_metrics(self) -> list[dict[str, Any]]:
        rows = []
        for step in self.metric_steps():
            rows.extend(
                self._read_parquet(self.path("metrics", f"step={step}.parquet")).to_pylist()
            )
        return rows

    # ---------------------------------------------------------- json, events

    def write_json(self, name: str, data: Any) -> None:
        self._write_bytes(self.path(name), json.dumps(data, indent=2, sort_keys=True).encode())

    def write_file(self, name: str, data: bytes) -> str:
        """Write ``name`` in the run's folder, whole (e.g. its ``curve.png``); returns its URI."""
        self._write_bytes(self.path(name), data)
        return f"{self.uri}/{name}"

    def read_json(self, name: str) -> Any | None:
        """``name`` whole, old or new, also while another process rewrites it (a control file such
        as a trainer node's address): one GET. Through ``fs.open`` an object store's file is a HEAD
        and then ranged GETs that must match the HEAD's ETag, and a rewrite between the two failed
        the run (s3fs's ``FileExpired``, CI: a restarted node 0 rewrote its address as the run read
        it)."""
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except FileNotFoundError:
            return None

    def append_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event (thread-safe within this process; one writing process per run).

        Local: a line appended to ``events.jsonl``. Object stores have no append: the events go
        to segment objects ``events/part-<N>.jsonl`` of at most ``EVENTS_PER_SEGMENT`` lines,
        and an append rewrites only the current segment (one PUT of at most that many lines),
        so its cost does not grow with the run (rewriting one ``events.jsonl`` made a long run's
        appends quadratic). Each PUT is atomic: a segment is whole, old or new.
        """
        event = {"time": time.time(), "event": kind, **fields}
        line = (json.dumps(event) + "\n").encode()
        with _EVENTS_LOCK:
            if self.is_local:
                self._append(self.path("events.jsonl"), line)
            else:
                self._append_to_segment(line)
        return event

    def _append(self, target: str, line: bytes) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "ab") as fh:
            fh.write(line)

    def _segment_path(self, index: int) -> str:
        return self.path("events", f"part-{index:06d}.jsonl")

    def _event_segments(self) -> list[str]:
        self.fs.invalidate_cache(self.path("events"))
        try:
            found = self.fs.glob(self.path("events", "part-*.jsonl"))
        except FileNotFoundError:
            return []
        return sorted(found, key=lambda p: int(_SEGMENT.search(p).group(1)))

    def _append_to_segment(self, line: bytes) -> None:
        """Called under ``_EVENTS_LOCK``. The current segment is kept in memory per run URI (every
        ``RunStorage`` of the run in this process shares it); a new process reads it back once."""
        state = _SEGMENTS.get(self.uri)
        if state is None:
            segments = self._event_segments()
            if segments:
                last = segments[-1]
                data = self.fs.cat_file(last)
                state = (int(_SEGMENT.search(last).group(1)), data, data.count(b"\n"))
            else:
                state = (0, b"", 0)
        index, data, count = state
        if count >= EVENTS_PER_SEGMENT:
            index, data, count = index + 1, b"", 0
        self._write_bytes(self._segment_path(index), data + line)
        _SEGMENTS[self.uri] = (index, data + line, count + 1)

    def read_events(self) -> list[dict[str, Any]]:
        """Every event in order: ``events.jsonl`` (local, or written by an older version on an
        object store), then the segments ``events/part-*.jsonl``."""
        chunks = []
        try:
            chunks.append(self.fs.cat_file(self.path("events.jsonl")))
        except FileNotFoundError:
            pass
        if not self.is_local:
            segments = self._event_segments()
            if segments:
                found = self.fs.cat(segments)
                chunks += [found[p] for p in segments]
        # A torn last line (killed mid-write) is skipped, never fatal.
        events = []
        for line in b"".join(chunks).decode().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    # --------------------------------------------------------- whole folders

    def upload_dir(self, local: str | Path, kind: str, step: int) -> str:
        """Copy a local folder into ``<kind>/step=<N>`` and commit it."""
        self.clear_uncommitted(kind, step)
        files = [f for f in sorted(Path(local).rglob("*")) if f.is_file() and f.name != SUCCESS]
        self.upload_files(local, [f.relative_to(local).as_posix() for f in files], kind, step)
        self.commit(kind, step)
        return self.step_uri(kind, step)

    def upload_files(self, local: str | Path, files: list[str], kind: str, step: int) -> None:
        """Copy ``files`` (paths relative to ``local``) into ``<kind>/step=<N>``, uncommitted.

        Several writers may upload parts of one step folder (the trainer ranks of several
        nodes); one of them commits once all are done.
        """
        folder = self.step_dir(kind, step)
        self.fs.makedirs(folder, exist_ok=True)
        for num_files, name in enumerate(files):
            file, remote = Path(local) / name, f"{folder}/{name}"
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            try:
                self.fs.put_file(str(file), remote)
            except OSError as exc:
                raise StorageError(f"uploading {file} to {remote}: {exc}") from exc
            if kind == "checkpoints" and num_files == 0:
                fault_point("checkpoint_upload")  # once per upload, after its first file

    def local_copy(self, kind: str, step: int, cache: str | Path) -> Path:
        """A local folder holding a committed step folder (itself, when storage is local).

        The copy lives under ``cache`` in a folder named by a hash of the step folder's URI, and
        gets the remote marker's commit id as its own ``_SUCCESS`` after every file: an
        interrupted copy, or one of another commit at the same URI (a run deleted and started
        again, another endpoint), is made again.
        """
        marker = f"{self.step_dir(kind, step)}/{SUCCESS}"
        try:
            commit_id = self.fs.cat_file(marker)
        except FileNotFoundError:
            raise StorageError(
                f"{self.step_uri(kind, step)} is not committed (no {SUCCESS})"
            ) from None
        except OSError as exc:
            raise StorageError(f"reading {marker}: {exc}") from exc
        if self.is_local:
            return Path(self.step_dir(kind, step))
        key = hashlib.sha256(self.step_uri(kind, step).encode()).hexdigest()[:16]
        target = Path(cache) / f"{self.run}-{kind}-step={step}-{key}"
        local_marker = target / SUCCESS
        target.parent.mkdir(parents=True, exist_ok=True)
        # Processes of one host (the trainer's ranks) copy into one cache: one at a time.
        lock = os.open(target.parent, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (local_marker.exists() and local_marker.read_bytes() == commit_id):
                self._download(kind, step, target)
                local_marker.write_bytes(commit_id)
        finally:
            os.close(lock)  # and with it the lock
        return target

    def _download(self, kind: str, step: int, target: Path) -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        source = self.step_dir(kind, step)
        for remote in self.fs.find(source):
            if remote.rsplit("/", 1)[-1] == SUCCESS:
                continue  # written last, by the caller: a copy cut short must not look whole
            local = target / remote[len(source) + 1 :]
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(remote, str(local))
            except OSError as exc:
                raise StorageError(f"downloading {remote} to {local}: {exc}") from exc

    # ---------------------------------------------------------------- helpers

    def _write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole file so that no reader sees half of it."""
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{os.getpid()}"
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
            else:  # one PUT: an object is either whole or absent
                self.fs.pipe_file(path, data)
        except OSError as exc:
            raise StorageError(f"writing {path}: {exc}") from exc


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()
