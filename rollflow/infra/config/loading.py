"""Loading a config: TOML, ``key.path=value`` overrides, validation with errors a user can act on."""

from __future__ import annotations

import copy
import difflib
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rollflow.infra.config.root import RunConfig
from rollflow.infra.errors import ConfigError


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (or nothing), apply ``a.b=value`` overrides, validate."""
    data: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        run = data.get("run")
        if run is None or isinstance(run, dict):  # (a wrong type is the validation's to name)
            stem = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem)  # a name the run may have
            data.setdefault("run", {}).setdefault("name", stem)
    for item in overrides:
        apply_override(data, item)
    _servers_from_environment(data)
    return validate_config(data, source)


URLS_ENV = "ROLLFLOW_VLLM_URLS"  # servers started elsewhere (`rollflow serve`), comma-separated


def _servers_from_environment(data: dict[str, Any]) -> None:
    """``inference.urls`` from ``URLS_ENV`` where the config and its overrides name none: the
    way a deployment (or a test) hands a run the servers it started."""
    urls = [u.strip() for u in os.environ.get(URLS_ENV, "").split(",") if u.strip()]
    inference = data.setdefault("inference", {}) if urls else None
    if isinstance(inference, dict) and not inference.get("urls"):
        inference["urls"] = urls


def resolve_config(config: str | Path | dict, overrides: Sequence[str] = ()) -> RunConfig:
    """A config path or dict (a deployment's parameter), with overrides applied, validated."""
    if isinstance(config, dict):
        data = copy.deepcopy(config)
        for item in overrides:
            apply_override(data, item)
        return validate_config(data, "config parameter")
    return load_config(config, list(overrides))


UNSET_VALUES = ("none", "null")


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in ``data``; value is parsed as TOML, else kept as a string.

    ``~a.b.c`` and ``a.b.c=none`` (or ``null``) remove the key, so it takes its default (a
    section such as ``model.tiny`` is then unset): the way to switch the quickstart to
    ``model.path`` from the command line. A string "none" is written ``a.b.c='"none"'``.
    """
    item = item.strip()
    if item.startswith("~"):
        key, raw, unset = item[1:], "", True
        if "=" in key:
            raise ConfigError(f"override {item!r}: ~key removes a key and takes no value")
    else:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(
                f"override {item!r} is not of the form key.path=value (or ~key.path to remove it)"
            )
        unset = raw.strip().lower() in UNSET_VALUES
    if not key.strip():
        raise ConfigError(f"override {item!r} names no key")
    *parents, leaf = key.strip().split(".")
    if unset:
        _remove(data, parents, leaf, item)
        return
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    node: Any = data
    for depth, part in enumerate(parents):
        if isinstance(node, list):
            node = node[_list_index(node, part, parents[:depth], item)]
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {item!r}: item {part} of {'.'.join(parents[:depth])!r} is "
                    f"not a table"
                )
            continue
        following = [*parents, leaf][depth + 1]
        child = node.setdefault(part, [] if following.isdigit() else {})
        if not isinstance(child, dict | list):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        if isinstance(child, list) and not child:
            node.pop(part)
            raise ConfigError(
                f"override {item!r}: the config sets no {'.'.join(parents[: depth + 1])!r} "
                "items to address by index; add them to the config file first"
            )
        node = child
    if isinstance(node, list):
        node[_list_index(node, leaf, parents, item)] = value
    else:
        node[leaf] = value


def _list_index(items: list, part: str, where: list[str], item: str) -> int:
    """``part`` as an index of the config's list ``where`` (``envs.0``), or a clear error."""
    name = ".".join(where)
    if not part.isdigit():
        raise ConfigError(
            f"override {item!r}: {name!r} is a list; address an item by its index "
            f"({name}.0 ... {name}.{len(items) - 1}), not {part!r}"
        )
    index = int(part)
    if index >= len(items):
        raise ConfigError(
            f"override {item!r}: index {index} is out of range: {name!r} has {len(items)} "
            f"item{'s' if len(items) != 1 else ''} ({name}.0 ... {name}.{len(items) - 1})"
        )
    return index


def _remove(data: dict[str, Any], parents: list[str], leaf: str, item: str) -> None:
    """Remove ``parents.leaf`` if present; a key the config tree does not know is an error."""
    known = _known_keys(parents)
    if leaf not in known:
        suggestion = _suggest(parents, leaf, known)
        path = ".".join([*parents, leaf])
        raise ConfigError(
            f"override {item!r}: unknown key {path!r}{suggestion} "
            f"(known: {', '.join(sorted(known)) or 'none'})"
        )
    node: Any = data
    for part in parents:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return
    if isinstance(node, dict):
        node.pop(leaf, None)


def validate_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a raw dict; errors name the offending key path and the fix."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config\n" + _explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            *parent, leaf = [str(p) for p in err["loc"]]
            known = _known_keys(parent)
            suggestion = _suggest(parent, leaf, known)
            lines.append(f"  unknown key {loc!r}{suggestion} (known: {', '.join(sorted(known))})")
        else:
            lines.append(f"  {loc or '<root>'}: {err['msg']}")
    return "\n".join(lines)


def _suggest(parent: list[str], leaf: str, known: list[str]) -> str:
    """The closest known key, also one section down (``train.kl_coef`` -> ``train.loss.kl_coef``)."""
    nested = {f"{key}.{sub}": sub for key in known for sub in _known_keys([*parent, key])}
    # A key of the same section wins over one a section down of the same name.
    by_leaf = {sub: path for path, sub in nested.items()} | {key: key for key in known}
    hint = difflib.get_close_matches(leaf, list(by_leaf), n=1)
    return f"; did you mean {'.'.join([*parent, by_leaf[hint[0]]])!r}?" if hint else ""


def _known_keys(parent: list[str]) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in parent:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return cfg.model_dump(mode="json")
