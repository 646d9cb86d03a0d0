"""Prompt datasets from local files: JSONL, Parquet, or a Hugging Face ``save_to_disk`` folder.

One loader for every format (picked from the path, or named with ``format=``). Each row gives a
prompt and, optionally, a reference answer, read from named columns.

Invariant: every row of the source is either returned or counted as skipped, with the reason of
the first few named by line (JSONL, 1-based) or row (tables, 0-based). A malformed row (bad
JSON, missing column, wrong type, empty prompt) is never fatal and never silent: it is skipped,
counted in ``LoadedDataset.num_skipped``, and one warning names the file, the first few rows and
the count. A source with no usable row at all is an error naming the file.

Nothing is downloaded: a path that does not exist locally is an error, not a hub id.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from rollflow.infra.errors import InputError

log = logging.getLogger(__name__)

Format = Literal["auto", "jsonl", "parquet", "hf"]
FORMATS = ("jsonl", "parquet", "hf")
MAX_REPORTED = 5  # skipped rows named in the warning


@dataclass(frozen=True)
class PromptRow:
    """One usable row: its position in the source, the prompt, and the reference answer."""

    index: int  # 0-based row of the source (JSONL: line number - 1)
    prompt: str
    answer: str
    # The row's other columns (metadata for plain reward functions).
    fields: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class LoadedDataset:
    """The usable rows of one source and what was skipped."""

    source: str  # the file or folder (and split) it came from
    rows: tuple[PromptRow, ...]
    num_skipped: int
    first_skipped: tuple[str, ...]  # "line 7: bad JSON (...)" for the first few skipped rows


def load_prompts(
    path: str | Path,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    format: Format = "auto",
    split: str | None = None,
) -> LoadedDataset:
    """The rows of ``path`` with a non-empty string prompt (and a str/number answer, if asked).

    ``format="auto"`` picks by suffix (``.jsonl``/``.ndjson``, ``.parquet``) or, for a folder, by
    its contents (a ``save_to_disk`` folder, or a folder of ``*.parquet`` files). ``split`` names
    the split of a saved ``DatasetDict``. Loads are cached per process (keyed by the file's
    modification time and size), so a dataset read at every step is parsed, and reported, once.
    """
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise InputError(
            f"dataset {path}: no such file or folder (datasets are read from local "
            "paths only; save a hub dataset with datasets' save_to_disk first)"
        )
    fmt = detect_format(p) if format == "auto" else format
    if fmt not in FORMATS:
        raise InputError(
            f"dataset {path}: unknown format {format!r}; use one of auto, {', '.join(FORMATS)}"
        )
    stat = p.stat()
    return _load_cached(
        str(p), (stat.st_mtime_ns, stat.st_size), fmt, prompt_column, answer_column, split
    )


def detect_format(p: Path) -> str:
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return "hf"
        if any(p.glob("*.parquet")):
            return "parquet"
        raise InputError(
            f"dataset {p}: a folder that is neither a datasets save_to_disk folder "
            "(dataset_dict.json or state.json) nor a folder of *.parquet files"
        )
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise InputError(
        f"dataset {p}: cannot tell the format from the suffix {suffix!r}; "
        f"use .jsonl or .parquet, or set format to one of {', '.join(FORMATS)}"
    )


@lru_cache(maxsize=32)
def _load_cached(
    path: str,
    _version: tuple[int, int],
    fmt: str,
    prompt_column: str,
    answer_column: str | None,
    split: str | None,
) -> LoadedDataset:
    columns = [prompt_column] + ([answer_column] if answer_column else [])
    if fmt == "jsonl":
        source, records = path, _jsonl_records(Path(path))
        where = "line"
    else:
        table = (
            _read_parquet(Path(path), columns) if fmt == "parquet" else _read_hf(Path(path), split)
        )
        source = path if split is None else f"{path} (split {split})"
        _require_columns(source, table.column_names, columns)
        records = _table_records(table, table.column_names)
        where = "row"
    rows, skipped = [], []
    for index, record in records:
        row = (
            record
            if isinstance(record, str)
            else _prompt_row(index, record, prompt_column, answer_column)
        )
        if isinstance(row, PromptRow):
            rows.append(row)
        else:
            skipped.append(f"{where} {index + 1 if where == 'line' else index}: {row}")
    loaded = LoadedDataset(source, tuple(rows), len(skipped), tuple(skipped[:MAX_REPORTED]))
    if not rows:
        detail = (
            f"; first problems: {'; '.join(loaded.first_skipped)}" if skipped else " (it is empty)"
        )
        raise InputError(f"dataset {source}: no usable rows out of {len(skipped)}{detail}")
    if skipped:
        log.warning(
            "dataset %s: skipped %d malformed of %d rows (%s%s)",
            source,
            len(skipped),
            len(skipped) + len(rows),
            "; ".join(loaded.first_skipped),
            "; ..." if len(skipped) > MAX_REPORTED else "",
        )
    return loaded


def _prompt_row(
    index: int, record: Any, prompt_column: str, answer_column: str | None
) -> PromptRow | str:
    """The row, or why it is malformed."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    prompt = record.get(prompt_column)
    if prompt is None:
        return f"missing {prompt_column!r}"
    if not isinstance(prompt, str):
        return f"{prompt_column!r} is {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return f"empty {prompt_column!r}"
    answer = ""
    if answer_column:
        value = record.get(answer_column)
        if value is None:
            return f"missing {answer_column!r}"
        # Numbers are common reference answers (42, 0.5); bools and containers are not.
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return f"{answer_column!r} is {type(value).__name__}, not a string or number"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{answer_column!r} is {value}"
        answer = str(value)
    other = {k: v for k, v in record.items() if k not in (prompt_column, answer_column)}
    return PromptRow(index, prompt, answer, other)


def _jsonl_records(p: Path):
    """(0-based line, object or why the line is not one); blank lines are skipped without count."""
    with p.open("rb") as f:
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield index, f"not UTF-8 ({exc.reason} at byte {exc.start})"
                continue
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as exc:
                yield index, f"bad JSON ({exc.msg} at column {exc.colno})"


def _table_records(table, columns: list[str]):
    values = [table.column(c).to_pylist() for c in columns]
    for index, row in enumerate(zip(*values, strict=True)):
        yield index, dict(zip(columns, row, strict=True))


def _require_columns(source: str, have: list[str], want: list[str]) -> None:
    """A column absent from a whole table is every row malformed: say which and what exists."""
    missing = [c for c in want if c not in have]
    if missing:
        raise InputError(
            f"dataset {source}: no usable rows: column {missing[0]!r} is missing "
            f"(columns: {', '.join(have)}); set prompt_column / answer_column"
        )


def _read_parquet(p: Path, columns: list[str]):
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(p) if p.is_file() else pq.ParquetDataset(p).schema
        _require_columns(str(p), schema.names, columns)
        return pq.read_table(p)
    except InputError:
        raise
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise InputError(f"dataset {p}: not a readable Parquet file: {exc}") from exc


def _read_hf(p: Path, split: str | None):
    try:
        import datasets
    except ImportError as exc:
        raise InputError(
            f"dataset {p}: reading a save_to_disk folder needs the datasets package: "
            "pip install datasets"
        ) from exc
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise InputError(
            f"dataset {p}: not a readable datasets save_to_disk folder: {exc}"
        ) from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            what = "names no split" if split is None else f"has no split {split!r}"
            raise InputError(
                f"dataset {p}: a DatasetDict whose splits are {sorted(ds)}; the env "
                f"{what}: set split (and eval_split) to one of them"
            )
        ds = ds[split]
    elif split is not None:
        raise InputError(
            f"dataset {p}: a single Dataset has no splits, but split={split!r} was set"
        )
    return ds.with_format("arrow")[:]
