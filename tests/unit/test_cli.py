"""`rollflow status`: the table of a run's steps, with the columns its metrics have."""

from __future__ import annotations

from rollflow.cli import main
from rollflow.infra.storage import RunStorage


def fake_run(root, name: str, num_steps: int, pipelined: bool) -> RunStorage:
    storage = RunStorage(str(root), name)
    storage.write_metrics(0, {"eval_reward": 0.5})
    for step in range(1, num_steps + 1):
        row = {
            "reward_mean": 0.5 + step / 100,
            "num_groups_kept": 100,
            "loss": 0.01,
            "generate_phase_s": 2.0,
            "advantage_phase_s": 0.05,
            "train_phase_s": 1.5,
            "sync_phase_s": 0.1,
            "step_s": 3.7,
        }
        if pipelined:
            row.update(staleness_mean=0.75, staleness_max=1, trainer_wait_for_data_s=0.25)
        storage.write_metrics(step, row)
        storage.commit("checkpoints", step)
    storage.append_event("training_finished", step=num_steps)
    return storage


def test_status_shows_staleness_and_timings_when_the_run_has_them(tmp_path, capsys):
    fake_run(tmp_path, "async", 3, pipelined=True)
    assert main(["status", "async", "--storage", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "step",
        "reward",
        "eval",
        "kept",
        "loss",
        "stale",
        "stale_mx",
        "gen_s",
        "adv_s",
        "train_s",
        "wait_s",
        "sync_s",
        "step_s",
    ]
    assert lines[1].split() == ["0", "-", "0.500", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[3].split() == [
        "2",
        "0.520",
        "-",
        "100",
        "+0.0100",
        "0.75",
        "1",
        "2.00",
        "0.05",
        "1.50",
        "0.25",
        "0.10",
        "3.70",
    ]
    assert lines[-1].startswith("3 steps committed (last: 3), training finished")


def test_status_leaves_out_columns_no_row_has(tmp_path, capsys):
    fake_run(tmp_path, "sync", 2, pipelined=False)
    assert main(["status", "sync", "--storage", str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header == [
        "step",
        "reward",
        "eval",
        "kept",
        "loss",
        "gen_s",
        "adv_s",
        "train_s",
        "sync_s",
        "step_s",
    ]


def test_status_of_an_unknown_run_says_where_it_looked(tmp_path, capsys):
    assert main(["status", "nope", "--storage", str(tmp_path)]) == 2
    assert f"no run 'nope' in {tmp_path} (nothing at {tmp_path}/nope)" in capsys.readouterr().err
    RunStorage(str(tmp_path), "new").write_json("config.json", {})  # started, no step yet
    assert main(["status", "new", "--storage", str(tmp_path)]) == 2
    assert f"no metrics for run 'new' in {tmp_path}/new" in capsys.readouterr().err
