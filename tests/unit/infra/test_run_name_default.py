"""run.name defaults to the config file's name: two configs never share a run by accident (the
getting-started page's "a model of your own" config resumed the quickstart's run and trained
nothing, "all steps already committed")."""

from __future__ import annotations

from pathlib import Path

from rollflow.infra.config import load_config, resolve_config

ROOT = Path(__file__).resolve().parents[3]


def test_a_config_without_a_name_takes_its_files(tmp_path):
    text = (ROOT / "configs/quickstart.toml").read_text().replace('name = "quickstart"', "")
    mine = tmp_path / "my model.toml"
    mine.write_text(text)
    assert load_config(mine).run.name == "my-model"  # a name a run may have
    assert resolve_config(str(mine)).run.name == "my-model"
    assert load_config(mine, ["run.name=try2"]).run.name == "try2"  # an override still wins
    assert load_config(ROOT / "configs/quickstart.toml").run.name == "quickstart"  # its own name
    assert load_config(None, ["model.path='m'", "envs=[{name='add'}]"]).run.name == "quickstart"
