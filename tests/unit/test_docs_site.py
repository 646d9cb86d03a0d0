"""The reference pages' generated blocks (scripts/gen_reference.py): every config key and every CLI
command is on the committed pages, and the committed pages are what the code renders today.

Unit tests of the generator (no build, no mkdocs import); `.ci/run` builds the whole site with
`mkdocs build --strict`.
"""

import importlib.util
import re
import shutil
import typing
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from rollflow.infra.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts/gen_reference.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

CONFIG_PAGE = ROOT / "docs" / "reference" / "configuration.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"


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


def test_the_committed_reference_pages_are_what_the_code_renders():
    stale = gen.stale_pages()
    assert stale == [], "; ".join(gen.stale_message(page) for page in stale)


def test_a_stale_page_is_named_with_the_command_that_regenerates_it(tmp_path, capsys):
    for page in gen.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    config = tmp_path / "docs/reference/configuration.md"
    config.write_text(re.sub(r"^\| `run\.seed` .*\n", "", config.read_text(), flags=re.M))
    assert gen.stale_pages(tmp_path) == ["docs/reference/configuration.md"]
    assert gen.main(["--check"], root=tmp_path) == 1
    assert capsys.readouterr().err == (
        "docs/reference/configuration.md is stale: regenerate it with "
        "`.venv/bin/python scripts/gen_reference.py`\n"
    )
    assert gen.main([], root=tmp_path) == 0
    assert gen.stale_pages(tmp_path) == []
    assert config.read_text() == CONFIG_PAGE.read_text()


def test_the_configuration_page_has_a_row_for_every_key():
    page = CONFIG_PAGE.read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    keys = _leaf_keys(RunConfig)
    assert len(keys) > 100
    assert [k for k in keys if k not in rows] == []
    for heading in ("## `[run]`", "## `[[envs]]`", "## `[train.loss]`", "## `[train.lora]`"):
        assert heading in page


def test_a_row_shows_type_default_bounds_allowed_values_and_meaning():
    class Toy(BaseModel):
        """A toy section."""

        lr: float = Field(1e-4, gt=0, le=1, description="Learning rate.")
        kind: Literal["ppo", "gspo"] = Field("ppo", description="Loss | kind.")
        name: str | None = None  # no description: an empty meaning, not an error
        tags: list[str] = Field(default_factory=list, description="Tags.")

    class Root(BaseModel):
        toy: Toy = Field(default_factory=Toy)

    rows = gen.render(Root).splitlines()
    assert "| `toy.lr` | float | `0.0001` | > 0; ≤ 1 | Learning rate. |" in rows
    assert '| `toy.kind` | string | `"ppo"` | `"ppo"`, `"gspo"` | Loss \\| kind. |' in rows
    assert "| `toy.name` | string or none | unset |  |  |" in rows
    assert "| `toy.tags` | list of string | `[]` |  | Tags. |" in rows


def test_only_the_blocks_between_the_markers_are_rewritten():
    text = (
        "prose that quotes <!-- cli-help run:begin --> inline\n\n"
        "<!-- cli-help status:begin -->\nanything old\n<!-- cli-help status:end -->\n\nmore prose\n"
    )
    fresh = gen.regenerate(text)
    assert fresh.startswith("prose that quotes <!-- cli-help run:begin --> inline\n\n")
    assert fresh.endswith("<!-- cli-help status:end -->\n\nmore prose\n")
    assert "anything old" not in fresh and "usage: rollflow status [-h]" in fresh
    assert gen.regenerate(fresh) == fresh
    assert gen.regenerate("a page without blocks\n") == "a page without blocks\n"


def test_the_cli_page_has_the_help_of_every_command():
    commands = re.search(r"\{([a-z,-]+)\}", gen.cli_help("")).group(1).split(",")
    assert {"run", "plan", "status", "deploy", "export"} <= set(commands)
    page = CLI_PAGE.read_text()
    for command in commands:
        assert f"<!-- cli-help {command}:begin -->" in page
        assert f"usage: rollflow {command} [-h]" in page


def test_a_block_for_a_command_the_cli_lacks_or_without_its_end_is_an_error():
    with pytest.raises(ValueError, match="rollflow nope --help failed"):
        gen.regenerate("<!-- cli-help nope:begin -->\n<!-- cli-help nope:end -->")
    with pytest.raises(ValueError, match="cli.md: <!-- cli-help run:begin --> has no"):
        gen.regenerate("<!-- cli-help run:begin -->\nold\n", "cli.md")
    with pytest.raises(ValueError, match="no generated block is called 'tables'"):
        gen.regenerate("<!-- tables:begin -->\n<!-- tables:end -->")
