"""`rollflow scale`: what it asks of a run (control/fleet.json), and what it refuses."""

from __future__ import annotations

import json

import pytest

from rollflow.cli import main
from rollflow.infra.config import dump_config, validate_config
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.fleet import FLEET_CONTROL, Fleet, asked_servers, record_fleet


def a_run(root, **inference) -> RunStorage:
    storage = RunStorage(str(root), "grow")
    cfg = validate_config(
        {"model": {"path": "unused"}, "envs": [{"name": "add"}], "inference": inference}
    )
    storage.write_json("config.json", dump_config(cfg))
    return storage


def test_scale_asks_the_run_and_a_rerun_reads_the_same(tmp_path, capsys):
    storage = a_run(tmp_path, max_servers=3)
    assert asked_servers(storage) is None
    assert main(["scale", "grow", "--servers", "3", "--storage", str(tmp_path)]) == 0
    assert asked_servers(storage) == 3
    assert "asked run 'grow' for 3 vLLM server(s)" in capsys.readouterr().out
    assert main(["scale", "grow", "--servers", "1", "--storage", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "grow" / FLEET_CONTROL).read_text())["servers"] == 1


@pytest.mark.parametrize(
    ("servers", "setup", "expected"),
    [
        (2, {}, "2 server(s): run 'grow' has room for 1 to 1 server(s) (inference.max_servers)"),
        (0, {"max_servers": 2}, "0 server(s): run 'grow' has room for 1 to 2"),
        (1, None, "no run 'grow' in"),
        (1, "finished", "has finished training"),
    ],
)
def test_scale_refuses_what_the_run_cannot_do_and_changes_nothing(
    tmp_path, capsys, servers, setup, expected
):
    if setup is not None:
        storage = a_run(tmp_path, **({} if setup == "finished" else setup))
        if setup == "finished":
            storage.append_event("training_finished", step=3)
    assert main(["scale", "grow", "--servers", str(servers), "--storage", str(tmp_path)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "grow" / FLEET_CONTROL).exists()


@pytest.mark.parametrize("content", ['{"servers": 0}', '{"size": 2}', "[2]", "{not json"])
def test_a_control_file_edited_by_hand_is_named_with_how_to_write_it(tmp_path, content):
    storage = a_run(tmp_path, max_servers=2)
    (tmp_path / "grow" / "control").mkdir()
    (tmp_path / "grow" / FLEET_CONTROL).write_text(content)
    with pytest.raises(ValueError, match=r"control/fleet.json .*rollflow scale RUN --servers N"):
        asked_servers(storage)


def test_the_room_is_the_running_launchs_when_it_was_placed_for_more_than_the_first_config(
    tmp_path,
):
    """config.json keeps a run's first config; a rerun with inference.max_servers=2 records its
    own slots (control/fleet-state.json), and those are what `rollflow scale` allows."""
    storage = a_run(tmp_path)  # first config: one slot
    assert main(["scale", "grow", "--servers", "2", "--storage", str(tmp_path)]) == 2
    record_fleet(storage, 2, Fleet(["http://127.0.0.1:9"]))  # what the rerun's services write
    assert main(["scale", "grow", "--servers", "2", "--storage", str(tmp_path)]) == 0
    assert asked_servers(storage) == 2
