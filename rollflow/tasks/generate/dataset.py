"""Prompt datasets through Hugging Face ``datasets``: hub ids, local files and saved folders.

One loader for every source (picked from the path, or named with ``format=``):

- a hub id (``openai/gsm8k``, with ``subset`` and ``split``): ``datasets.load_dataset``, which
  reads the hub cache (``HF_HOME`` / ``HF_DATASETS_CACHE``) and honours ``HF_HUB_OFFLINE`` /
  ``HF_DATASETS_OFFLINE`` (offline, a dataset loaded once before is read from the cache);
- a local folder laid out as a dataset repository (data files, a README's configs):
  ``load_dataset`` on the folder;
- a ``save_to_disk`` folder: ``datasets.load_from_disk``;
- local ``.json`` / ``.csv`` files: ``load_dataset("json" | "csv")``; ``.jsonl`` is read line by
  line here (one bad line is a skipped row, not a failed load); ``.parquet`` files or a folder of
  them through pyarrow.

Each row gives a prompt, as text or as chat messages (TRL's conversational format: a list of
``{"role", "content"}``), and, optionally, a reference answer, read from named columns.

Invariant: every row of the source is either returned or counted as skipped, with the reason of
the first few named by line (JSONL, 1-based) or row (tables, 0-based). A malformed row (bad
JSON, missing column, wrong type, empty prompt, a message without role or content) is never fatal
and never silent: it is skipped, counted in ``LoadedDataset.num_skipped``, and one warning names
the source, the first few rows and the count. A source with no usable row at all is an error
naming it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from rollflow.infra.errors import InputError

log = logging.getLogger(__name__)

Format = Literal["auto", "jsonl", "json", "parquet", "csv", "hf", "hub"]
FORMATS = ("jsonl", "json", "parquet", "csv", "hf", "hub")
MAX_REPORTED = 5  # skipped rows named in the warning
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
SUFFIXES |= {".pq": "parquet", ".csv": "csv"}
# owner/name or name, as the hub spells repository ids (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class PromptRow:
    """One usable row: its position in the source, the prompt, and the reference answer.

    A chat row has ``messages`` (each a ``{"role", "content"}`` dict); its ``prompt`` is then the
    last user message's text (what the rollout rows show).
    """

    index: int  # 0-based row of the source (JSONL: line number - 1)
    prompt: str
    answer: str
    # The row's other columns (metadata for plain reward functions).
    fields: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False, compare=False)

    @property
    def key(self) -> str:
        """What identifies the prompt (the held-out split and de-duplication go by it)."""
        if self.messages is None:
            return self.prompt
        return json.dumps(self.messages, sort_keys=True, ensure_ascii=False)


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
    subset: str | None = None,
) -> LoadedDataset:
    """The rows of ``path`` with a usable prompt (and a str/number answer, if asked).

    ``path`` is a local file or folder, or else a hub id. ``format="auto"`` picks by suffix
    (``.jsonl``/``.ndjson``, ``.json``, ``.parquet``, ``.csv``), for a folder by its contents (a
    ``save_to_disk`` folder, a folder of ``*.parquet`` files, or a dataset repository), and a path
    that is not there locally is a hub id. ``split`` names the split (a hub or repository
    dataset's defaults to ``train``), ``subset`` a hub dataset's configuration (GSM8K's
    ``main``). Loads are cached per process (a local source keyed by its modification time and
    size), so a dataset read at every step is parsed, and reported, once.
    """
    if format != "auto" and format not in FORMATS:
        raise InputError(
            f"dataset {path}: unknown format {format!r}; use one of auto, {', '.join(FORMATS)}"
        )
    p = Path(path).expanduser()
    if not p.exists():
        if format not in ("auto", "hub") or not is_hub_id(str(path)):
            raise InputError(
                f"dataset {path}: no such file or folder, and not a hub dataset id "
                "(owner/name); check the path"
            )
        return _load_cached(str(path), None, "hub", prompt_column, answer_column, split, subset)
    p = p.resolve()
    fmt = detect_format(p) if format == "auto" else format
    if subset is not None and fmt != "hub":
        raise InputError(
            f"dataset {path}: subset={subset!r} names a configuration of a hub dataset or a "
            f"dataset repository folder; a {fmt} source has none: remove subset"
        )
    stat = p.stat()
    return _load_cached(
        str(p), (stat.st_mtime_ns, stat.st_size), fmt, prompt_column, answer_column, split, subset
    )


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a hub id (``owner/name``) rather than a local file."""
    return bool(HUB_ID.match(path)) and Path(path).suffix.lower() not in SUFFIXES


def detect_format(p: Path) -> str:
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return "hf"
        if any(p.glob("*.parquet")) and not (p / "README.md").exists():
            return "parquet"
        if (p / "README.md").exists() or any(
            f.suffix.lower() in SUFFIXES for f in p.rglob("*") if f.is_file()
        ):
            return "hub"  # a dataset repository: load_dataset finds its data files and splits
        raise InputError(
            f"dataset {p}: a folder that is neither a datasets save_to_disk folder "
            "(dataset_dict.json or state.json), a folder of *.parquet files, nor a dataset "
            "repository (data files, or a README.md naming them)"
        )
    suffix = p.suffix.lower()
    if suffix in SUFFIXES:
        return SUFFIXES[suffix]
    raise InputError(
        f"dataset {p}: cannot tell the format from the suffix {suffix!r}; use "
        f"{', '.join(sorted(SUFFIXES))}, or set format to one of {', '.join(FORMATS)}"
    )


@lru_cache(maxsize=32)
def _load_cached(
    path: str,
    _version: tuple[int, int],
    fmt: str,
    prompt_column: str,
    answer_column: str | None,
    split: str | None,
    subset: str | None,
) -> LoadedDataset:
    columns = [prompt_column] + ([answer_column] if answer_column else [])
    if fmt == "jsonl":
        source, records = path, _jsonl_records(Path(path))
        where = "line"
    else:
        if fmt == "parquet":
            table = _read_parquet(Path(path), columns)
        elif fmt == "hf":
            table = _read_hf(Path(path), split)
        else:
            split = (split or "train") if fmt == "hub" else split
            table = _read_with_datasets(path, fmt, split, subset)
        named = [f"subset {subset}"] * (subset is not None) + [f"split {split}"] * bool(split)
        source = f"{path} ({', '.join(named)})" if named else path
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
    messages = None
    if isinstance(prompt, list | tuple):
        messages = _messages(prompt, prompt_column)
        if isinstance(messages, str):
            return messages
        prompt = next(
            (m["content"] for m in reversed(messages) if m["role"] == "user"),
            messages[-1]["content"],
        )
    elif not isinstance(prompt, str):
        return f"{prompt_column!r} is {type(prompt).__name__}, not a string or a list of messages"
    elif not prompt.strip():
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
    return PromptRow(index, prompt, answer, other, messages)


def _messages(value: list | tuple, column: str) -> tuple[dict[str, str], ...] | str:
    """TRL's conversational prompt (``[{"role": "user", "content": "..."}]``), or why it is not
    one. A message's other keys (a table's null ``tool_calls``, say) are dropped."""
    if not value:
        return f"empty {column!r} (a list of no messages)"
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"{column!r} message {i} is {type(message).__name__}, not a {{role, content}} object"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"{column!r} message {i} has role {role!r}, not one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return f"{column!r} message {i} has content of type {type(content).__name__}, not text"
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        return f"empty {column!r} (every message's content is empty)"
    return tuple(out)


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


def _datasets(source: Any):
    try:
        import datasets
    except ImportError as exc:
        raise InputError(
            f"dataset {source}: reading it needs the datasets package: pip install datasets"
        ) from exc
    return datasets


def _read_with_datasets(path: str, fmt: str, split: str | None, subset: str | None):
    """A hub id or repository folder (``fmt="hub"``), or a .json/.csv file, as one Arrow table."""
    datasets = _datasets(path)
    if fmt == "hub":
        args, kwargs = (path, subset), {}
    else:
        args, kwargs = (fmt,), {"data_files": {"train": path}}
        split = split or "train"
    try:
        loaded = datasets.load_dataset(*args, **kwargs)
    except Exception as exc:  # datasets raises many types: not found, offline, bad file, config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = datasets.config.HF_HUB_OFFLINE
        hint = (
            "; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), a hub dataset is read only from "
            "the cache (HF_HOME / HF_DATASETS_CACHE) of an earlier load_dataset"
            if fmt == "hub" and offline
            else ""
        )
        raise InputError(f"dataset {path}: datasets cannot load it: {first}{hint}") from exc
    if split not in loaded:
        raise InputError(
            f"dataset {path}: its splits are {sorted(loaded)}; there is no split {split!r}: "
            "set split (and eval_split) to one of them"
        )
    return loaded[split].with_format("arrow")[:]


def _read_hf(p: Path, split: str | None):
    datasets = _datasets(p)
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
