"""Write the generated parts of the reference pages from the code, or check that they are current.

    .venv/bin/python scripts/gen_reference.py           # rewrite the stale pages
    .venv/bin/python scripts/gen_reference.py --check   # exit 1, naming each stale page

Owns: the rendering of the reference pages' generated blocks and the markers around them.

- ``docs/reference/configuration.md``: one table per section of ``RunConfig`` (every key: dotted
  name, type, default, allowed values or bounds, and the field's ``Field(description=...)``), in
  the block ``config-reference``. A field without a description renders with an empty meaning
  (the config's unit tests require descriptions).
- ``docs/reference/cli.md``: ``rollflow [COMMAND] --help`` as ``rollflow.cli.main`` prints it,
  100 columns wide, in the blocks ``cli-help`` and ``cli-help COMMAND``. A block naming a command
  the CLI does not have is an error.

A page is prose plus blocks ``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``; this script
rewrites what lies between the markers and nothing else. The blocks are committed, so a page
reads the same on the code host as on the docs site; ``tests/unit/test_docs_site.py`` fails
while a committed page differs from what this script writes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python scripts/gen_reference.py"
PAGES = ("docs/reference/configuration.md", "docs/reference/cli.md")
BLOCK = re.compile(
    r"^<!-- (?P<name>[a-z][a-z -]*?):begin -->\n(?P<body>.*?)^<!-- (?P=name):end -->$",
    re.M | re.S,
)
BEGIN = re.compile(r"^<!-- ([a-z][a-z -]*?):begin -->$", re.M)
_SOURCES = {
    "config-reference": "the config models (rollflow/infra/config/)",
    "cli-help": "rollflow/cli.py",
}

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "at least {} item(s)"),
    (annotated_types.MaxLen, "max_length", "at most {} item(s)"),
)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """Rewrite the stale pages, or with ``--check`` only name them (exit 1 if any)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = stale_pages(root)
    for page in stale:
        if args.check:
            print(stale_message(page), file=sys.stderr)
        else:
            path = root / page
            path.write_text(regenerate(path.read_text(), page))
            print(f"wrote {page}")
    return 1 if args.check and stale else 0


def stale_pages(root: Path = ROOT) -> list[str]:
    """The pages under ``root`` whose generated blocks differ from what the code renders now."""
    return [page for page in PAGES if regenerate(text := (root / page).read_text(), page) != text]


def stale_message(page: str) -> str:
    """What a check says of a stale page: its name and the command that rewrites it."""
    return f"{page} is stale: regenerate it with `{COMMAND}`"


def regenerate(text: str, page: str = "the page") -> str:
    """``text`` with the body of every generated block rendered anew; the prose is kept as is."""
    begun = BEGIN.findall(text)
    closed = [m.group("name") for m in BLOCK.finditer(text)]
    if begun != closed:
        name = next((n for n in begun if n not in closed), begun[0])
        raise ValueError(f"{page}: <!-- {name}:begin --> has no <!-- {name}:end --> after it")
    return BLOCK.sub(lambda m: _block(m.group("name")), text)


def _block(name: str) -> str:
    kind, _, arg = name.partition(" ")
    if kind == "config-reference" and not arg:
        from rollflow.infra.config import RunConfig

        body = render(RunConfig)
    elif kind == "cli-help":
        body = "```text\n" + cli_help(arg).rstrip() + "\n```"
    else:
        raise ValueError(f"no generated block is called {name!r}")
    note = (
        f"<!-- Generated from {_SOURCES[kind]} by `{COMMAND}`: "
        "do not edit by hand; change the code, then rerun it. -->"
    )
    return f"<!-- {name}:begin -->\n{note}\n\n{body.strip()}\n\n<!-- {name}:end -->"


def cli_help(command: str) -> str:
    """``rollflow [COMMAND] --help``, 100 columns wide; an unknown command is an error."""
    from rollflow.cli import main as cli_main

    argv = [command, "--help"] if command else ["--help"]
    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli_main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ValueError(
                f"rollflow {command} --help failed: {err.getvalue().strip()}"
            ) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def render(root: type[BaseModel]) -> str:
    """Every section of ``root`` as a heading and a table, depth first in field order."""
    out: list[str] = []
    top = [(name, f) for name, f in root.model_fields.items() if _section_of(f) is None]
    if top:
        out += _table("Top level", "", top)
    for name, field in root.model_fields.items():
        _walk(name, field, out)
    return "\n".join(out)


def _walk(path: str, field: FieldInfo, out: list[str]) -> None:
    section = _section_of(field)
    if section is None:
        return
    model, is_list = section
    key = f"{path}[]" if is_list else path
    heading = f"[[{path}]]" if is_list else f"[{path}]"
    leaves = [(n, f) for n, f in model.model_fields.items() if _section_of(f) is None]
    out += _table(heading, key, leaves, intro=_section_intro(model, field))
    for name, sub in model.model_fields.items():
        _walk(f"{key}.{name}", sub, out)


def _section_intro(model: type[BaseModel], field: FieldInfo) -> str:
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    parts = [_one_line(field.description or doc)]
    if _is_optional(field.annotation):
        parts.append("Unset by default: the section exists only when the config gives it.")
    elif field.is_required():
        parts.append("Required.")
    return _cell(" ".join(p for p in parts if p))


def _table(
    heading: str, prefix: str, fields: list[tuple[str, FieldInfo]], intro: str = ""
) -> list[str]:
    lines = [f"## `{heading}`" if prefix else f"## {heading}", ""]
    if intro:
        lines += [intro, ""]
    if not fields:
        return lines
    lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, f in fields:
        key = f"{prefix}.{name}" if prefix else name
        cells = (
            f"`{key}`",
            _type_name(f.annotation),
            _default(f),
            _allowed(f),
            _cell(_one_line(f.description or "")),
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _section_of(field: FieldInfo) -> tuple[type[BaseModel], bool] | None:
    """The model a field holds (a section), and whether it is a list of them, else None."""
    ann = _strip_none(field.annotation)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, False
    if typing.get_origin(ann) is list:
        (item,) = typing.get_args(ann) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _is_optional(ann: Any) -> bool:
    return _is_union(ann) and type(None) in typing.get_args(ann)


def _strip_none(ann: Any) -> Any:
    if _is_union(ann):
        rest = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return ann


def _type_name(ann: Any) -> str:
    if ann is type(None):
        return "none"
    if _is_union(ann):
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    origin = typing.get_origin(ann)
    if origin is Literal:
        kinds = {type(v) for v in typing.get_args(ann)}
        return _type_name(kinds.pop()) if len(kinds) == 1 else "one of the allowed"
    if origin is list:
        (item,) = typing.get_args(ann) or (Any,)
        return f"list of {_type_name(item)}"
    if origin is dict:
        return "table"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    names = {str: "string", int: "integer", float: "float", bool: "boolean", dict: "table"}
    if ann in names:
        return names[ann]
    return getattr(ann, "__name__", str(ann))


def _allowed(field: FieldInfo) -> str:
    parts = []
    literal = _literal_values(field.annotation)
    if literal:
        parts.append(", ".join(f"`{_toml(v)}`" for v in literal))
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                value = getattr(meta, attr)
                parts.append(sign.format(value) if "{}" in sign else f"{sign} {value}")
    return "; ".join(parts)


def _literal_values(ann: Any) -> list[Any]:
    """Literal values anywhere in the annotation (inside Optional or list too)."""
    if typing.get_origin(ann) is Literal:
        return list(typing.get_args(ann))
    values: list[Any] = []
    for arg in typing.get_args(ann):
        values += _literal_values(arg)
    return values


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return ""
    return "unset" if value is None else f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Prose for a table cell, as written: outside its code spans, a pipe would end the cell,
    ``<x>`` would be an HTML tag and ``*`` or ``_`` emphasis, so they are escaped there."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        part = parts[i].replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
        parts[i] = part.replace("_", "\\_").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


if __name__ == "__main__":
    sys.exit(main())
