"""MkDocs hook: the configuration reference, rendered from the pydantic config models at build time.

Owns: the page's tables. ``docs/reference/configuration.md`` holds the prose and the marker
``<!-- config-reference -->``; this hook replaces the marker with one table per section of
``RunConfig`` (every key: dotted name, type, default, allowed values or bounds, and the field's
``Field(description=...)``), so the page follows the code and cannot drift. A field without a
description renders with an empty meaning (the config's unit tests require descriptions).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- config-reference -->"
PAGE = "reference/configuration.md"

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "at least {} item(s)"),
    (annotated_types.MaxLen, "max_length", "at most {} item(s)"),
)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace the marker of the configuration page with the rendered tables."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE}: the marker {MARKER} is missing")
    from rollflow.infra.config import RunConfig

    return markdown.replace(MARKER, render(RunConfig))


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
