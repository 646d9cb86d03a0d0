"""The docs site's generated pages (docs/hooks/): every config key and every CLI command is on them.

Unit tests of the MkDocs hooks (no build, no mkdocs import); `.ci/run` builds the whole site with
`mkdocs build --strict`.
"""

import importlib.util
import re
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from rollflow.infra.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


config_reference = _hook("config_reference")
cli_reference = _hook("cli_reference")


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key that holds a value (not a section), as the page writes it (`envs[].name`)."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
        sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if typing.get_origin(ann) is list and args and isinstance(args[0], type):
            if issubclass(args[0], BaseModel):
                keys += _leaf_keys(args[0], f"{prefix}{name}[].")
                continue
        if sub is not None:
            keys += _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _page(src_uri: str):
    return SimpleNamespace(file=SimpleNamespace(src_uri=src_uri))


def test_the_configuration_page_has_a_row_for_every_key():
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    rendered = config_reference.on_page_markdown(page, page=_page(config_reference.PAGE))
    assert config_reference.MARKER not in rendered
    rows = set(re.findall(r"^\| `([^`]+)` \|", rendered, flags=re.M))
    keys = _leaf_keys(RunConfig)
    assert len(keys) > 100
    assert [k for k in keys if k not in rows] == []
    for heading in ("## `[run]`", "## `[[envs]]`", "## `[train.loss]`", "## `[train.lora]`"):
        assert heading in rendered


def test_a_row_shows_type_default_bounds_allowed_values_and_meaning():
    class Toy(BaseModel):
        """A toy section."""

        lr: float = Field(1e-4, gt=0, le=1, description="Learning rate.")
        kind: Literal["ppo", "gspo"] = Field("ppo", description="Loss | kind.")
        name: str | None = None  # no description: an empty meaning, not an error
        tags: list[str] = Field(default_factory=list, description="Tags.")

    class Root(BaseModel):
        toy: Toy = Field(default_factory=Toy)

    rows = config_reference.render(Root).splitlines()
    assert "| `toy.lr` | float | `0.0001` | > 0; ≤ 1 | Learning rate. |" in rows
    assert '| `toy.kind` | string | `"ppo"` | `"ppo"`, `"gspo"` | Loss \\| kind. |' in rows
    assert "| `toy.name` | string or none | unset |  |  |" in rows
    assert "| `toy.tags` | list of string | `[]` |  | Tags. |" in rows


def test_other_pages_are_left_alone():
    text = f"a page that quotes {config_reference.MARKER}"
    assert config_reference.on_page_markdown(text, page=_page("index.md")) == text
    assert cli_reference.on_page_markdown(text, page=_page("index.md")) == text


def test_the_cli_page_has_the_help_of_every_command():
    commands = re.search(r"\{([a-z,-]+)\}", cli_reference.cli_help("")).group(1).split(",")
    assert {"run", "plan", "status", "deploy", "export"} <= set(commands)
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    rendered = cli_reference.on_page_markdown(page, page=_page(cli_reference.PAGE))
    assert "<!-- cli-help" not in rendered
    for command in commands:
        assert f"usage: rollflow {command} [-h]" in rendered


def test_a_marker_for_a_command_the_cli_lacks_fails_the_build():
    with pytest.raises(ValueError, match="rollflow nope --help failed"):
        cli_reference.on_page_markdown("<!-- cli-help nope -->", page=_page(cli_reference.PAGE))
