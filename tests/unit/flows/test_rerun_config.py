"""A rerun of a committed run with another model or environments is refused, never resumed."""

import pyarrow as pa
import pytest

from rollflow.flows.rl_run import _record_config
from rollflow.infra.config import validate_config
from rollflow.infra.errors import ConfigError
from rollflow.infra.storage import RunStorage


def _cfg(tmp_path, *overrides):
    raw = {
        "run": {"storage": str(tmp_path)},
        "model": {"path": "/models/a"},
        "envs": [{"name": "add"}],
    }
    for key, value in overrides:
        section, _, name = key.partition(".")
        if name:
            raw.setdefault(section, {})[name] = value
        else:
            raw[section] = value
    return validate_config(raw)


def _committed_run(tmp_path):
    cfg = _cfg(tmp_path)
    storage = RunStorage(cfg.run.storage, cfg.run.name)
    _record_config(storage, cfg)
    storage.write_step_table("rollouts", 1, pa.table({"x": [1]}))
    return storage


def test_a_rerun_with_another_model_is_refused_naming_the_key_and_both_ways_on(tmp_path):
    storage = _committed_run(tmp_path)
    with pytest.raises(ConfigError) as err:
        _record_config(storage, _cfg(tmp_path, ("model.path", "/models/b")))
    assert str(err.value) == (
        f"run.name = 'quickstart': {storage.uri} holds a run with another model.path; start a "
        "new run with run.name=<new name>, or resume it with the new values with "
        "run.resume_changed=true"
    )
    with pytest.raises(ConfigError, match="another envs;"):
        _record_config(storage, _cfg(tmp_path, ("envs", [{"name": "sort_letters"}])))
    assert storage.read_json("config.json")["model"]["path"] == "/models/a"


def test_the_same_run_other_settings_or_the_explicit_flag_go_on(tmp_path, capsys):
    storage = _committed_run(tmp_path)
    _record_config(storage, _cfg(tmp_path))
    _record_config(storage, _cfg(tmp_path, ("sampling.temperature", 0.5)))
    _record_config(
        storage, _cfg(tmp_path, ("model.path", "/models/b"), ("run.resume_changed", True))
    )
    assert (
        "config differs from the run's first config.json in model.path" in capsys.readouterr().out
    )


def test_a_run_with_nothing_committed_takes_the_new_config(tmp_path):
    cfg = _cfg(tmp_path)
    storage = RunStorage(cfg.run.storage, cfg.run.name)
    _record_config(storage, cfg)
    _record_config(storage, _cfg(tmp_path, ("model.path", "/models/b")))
    assert storage.read_json("config.json")["model"]["path"] == "/models/b"
