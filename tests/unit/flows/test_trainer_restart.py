"""A lost trainer is restarted from the run's last committed checkpoint, at most
``trainer.max_restarts`` times (rl_run._restart_trainer); the whole heal on real services is
tests/integration/flows/test_chaos_trainer.py. A rerun of a run whose steps are all committed
records the end a lost process did not say (rl_run._finish_committed_run)."""

from __future__ import annotations

import json

import pytest

from rollflow.flows import rl_run
from rollflow.infra.config import load_config
from rollflow.infra.errors import ServiceError, TrainerLost
from rollflow.infra.storage import RunStorage
from rollflow.infra.terminal import one_line

LOST = TrainerLost(
    "the trainer has exited (code 1): trainer rank 1 (pid 7) died (exit code -9); "
    "last lines of runs/heal/logs/trainer.log:\nKilled"
)


@pytest.fixture(autouse=True)
def no_prefect(monkeypatch):
    import prefect.events

    # The event's Prefect mirror: a unit test reaches no Prefect API.
    monkeypatch.setattr(prefect.events, "emit_event", lambda **kw: None)


class Services:
    """What the heal asks of RunServices: a restart from a policy folder."""

    base_model = "/models/start"

    def __init__(self):
        self.calls = []

    def restart_trainer(self, policy_dir, checkpoint_step):
        self.calls.append((str(policy_dir), checkpoint_step))
        return checkpoint_step or 0


def _setup(tmp_path, *overrides, committed=(1, 2)):
    cfg = load_config(
        None,
        [
            "model.path='/models/start'",
            "envs=[{name='sort_letters'}]",
            f"run.storage='{tmp_path / 'runs'}'",
            "run.name='heal'",
            *overrides,
        ],
    )
    storage = RunStorage(cfg.run.storage, cfg.run.name)
    for step in committed:
        folder = tmp_path / "runs" / "heal" / "checkpoints" / f"step={step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        storage.commit("checkpoints", step)
    return cfg, storage


def test_the_trainer_restarts_from_the_last_committed_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(rl_run, "LOCAL_CACHE", tmp_path / "cache")
    cfg, storage = _setup(tmp_path)
    services = Services()
    assert rl_run._restart_trainer(cfg, storage, services, LOST, restarts=0) == 2
    [(policy_dir, step)] = services.calls
    assert step == 2 and policy_dir.endswith("checkpoints/step=2")  # local storage: in place
    events = [
        json.loads(x) for x in (tmp_path / "runs/heal/events.jsonl").read_text().split("\n") if x
    ]
    [event] = [e for e in events if e["event"] == "trainer_restarted"]
    assert event["restart"] == 1 and event["resumed_from"] == 2 and event["version"] == 2
    assert "rank 1 (pid 7) died" in event["reason"] and "Killed" not in event["reason"]


def test_before_any_checkpoint_the_trainer_restarts_from_the_starting_policy(tmp_path):
    cfg, storage = _setup(tmp_path, committed=())
    services = Services()
    assert rl_run._restart_trainer(cfg, storage, services, LOST, restarts=1) == 0
    assert services.calls == [("/models/start", None)]


@pytest.mark.parametrize(
    "overrides, restarts, why",
    [
        (["trainer.max_restarts=1"], 1, "not restarted: 1 of trainer.max_restarts = 1 used"),
        (["trainer.max_restarts=0"], 0, "not restarted: 0 of trainer.max_restarts = 0 used"),
        (
            ["trainer.num_nodes=2"],
            0,
            "a trainer whose other nodes were started by hand is not restarted by the run",
        ),
    ],
)
def test_a_trainer_that_may_not_restart_stops_the_run_saying_why(
    tmp_path, overrides, restarts, why
):
    cfg, storage = _setup(tmp_path, *overrides)
    services = Services()
    with pytest.raises(ServiceError) as failed:
        rl_run._restart_trainer(cfg, storage, services, LOST, restarts=restarts)
    assert not isinstance(failed.value, TrainerLost) and services.calls == []
    line = one_line(failed.value)  # what the terminal and the Prefect log show
    assert "rank 1 (pid 7) died" in line and why in line and "rerun to resume" in line
    assert line.endswith("see runs/heal/logs/trainer.log")


def test_a_trainer_whose_nodes_the_run_submits_is_restarted_whole(tmp_path):
    """The nodes are flow runs of trainer.node_deployment: the run can submit them again, so a
    lost node (node 0 too) restarts the trainer on every node from the last checkpoint."""
    cfg, storage = _setup(
        tmp_path,
        "trainer.num_nodes=2",
        "trainer.node_deployment='rollflow-trainer-node/default'",
        "trainer.master_addr=auto",
    )
    services = Services()
    assert rl_run._restart_trainer(cfg, storage, services, LOST, restarts=0) == 2
    assert len(services.calls) == 1


def test_a_rerun_of_a_run_lost_after_its_last_commit_records_its_end(tmp_path, monkeypatch):
    """Every step committed, the process lost before it said the end (the heal's rerun can meet
    this): the rerun trains nothing, starts no service, records ``training_finished`` once and
    shows the whole run on its flow run (progress and summary)."""
    cfg, storage = _setup(tmp_path, "run.num_steps=2")
    shown = []
    monkeypatch.setattr(rl_run, "RunProgress", lambda *a: shown.append(("progress", *a)))
    monkeypatch.setattr(rl_run, "publish_summary", lambda s: shown.append(("summary", s.run)))
    monkeypatch.setattr(rl_run, "prepare_policy", lambda cfg: pytest.fail("a policy prepared"))
    monkeypatch.setattr(rl_run, "RunServices", lambda *a, **k: pytest.fail("services started"))
    for _ in range(2):  # the rerun, then a rerun of the finished run: the end said once
        assert rl_run._train(cfg)["run"] == "heal"
    ends = [e for e in storage.read_events() if e["event"] == "training_finished"]
    assert [(e["step"], e["source"]) for e in ends] == [(2, "storage")]
    assert shown == [("progress", "heal", 2, 2), ("summary", "heal")] * 2
