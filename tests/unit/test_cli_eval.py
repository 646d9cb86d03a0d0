"""`rollflow eval`'s refusals: each one line, before any vLLM server starts."""

from __future__ import annotations

import pytest

from rollflow.cli import main
from rollflow.infra.storage import RunStorage

CONFIG = """
[run]
name = "{name}"
storage = "{storage}"

[model]
path = "unused"

[[envs]]
name = "add"
"""


@pytest.fixture
def config(tmp_path):
    def write(name: str = "r") -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(CONFIG.format(name=name, storage=tmp_path / "runs"))
        return str(path)

    return write


def error_of(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_no_such_run(config, capsys, tmp_path):
    line = error_of(["eval", config("ghost"), "--checkpoint", "2"], capsys)
    assert line.startswith("error: no run 'ghost' in ") and "--storage" in line


def test_no_such_checkpoint_names_the_committed_ones(config, capsys, tmp_path):
    storage = RunStorage(str(tmp_path / "runs"), "r")
    for step in (1, 2, 3, 5):
        storage.commit("checkpoints", step)
    line = error_of(["eval", config(), "--checkpoint", "4"], capsys)
    assert "no committed checkpoint of step 4" in line and line.endswith("committed steps: 1-3, 5")


def test_a_missing_model_folder(config, capsys, tmp_path):
    line = error_of(["eval", config(), "--model", str(tmp_path / "nope")], capsys)
    assert (
        line == f"error: --model {tmp_path / 'nope'}: no such folder; give an exported model folder"
    )
    (tmp_path / "empty").mkdir()
    line = error_of(["eval", config(), "--model", str(tmp_path / "empty")], capsys)
    assert "no config.json in it" in line


def test_bad_samples_and_overrides(config, capsys):
    assert "--samples 0: give 1 or more" in error_of(
        ["eval", config(), "--model", "m", "--samples", "0"], capsys
    )
    line = error_of(["eval", config(), "--model", "m", "sampling.eval_samples=0"], capsys)
    assert "sampling.eval_samples" in line


def test_checkpoint_or_model_is_required(config, capsys):
    with pytest.raises(SystemExit):
        main(["eval", config()])
    assert "one of the arguments --checkpoint --model is required" in capsys.readouterr().err
