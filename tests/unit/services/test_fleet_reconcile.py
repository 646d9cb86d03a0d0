"""What the run's services make of the fleet's control file (no server started: the decisions
before any process; the grow and shrink themselves run on real vLLM in test_scale_out)."""

from __future__ import annotations

from types import SimpleNamespace

from rollflow.infra.config import load_config
from rollflow.infra.placement import Machine
from rollflow.infra.vllm_fleet.fleet import FLEET_CONTROL, ask_for_servers
from rollflow.services import fleet_keeper
from rollflow.services.run_services import RunServices


def services(tmp_path, *overrides: str) -> tuple[fleet_keeper.FleetKeeper, list[str]]:
    cfg = load_config(
        None,
        [
            "model.path='unused'",
            "envs=[{name='add'}]",
            f"run.storage='{tmp_path}'",
            "run.name='fleet'",
            *overrides,
        ],
    )
    said: list[str] = []
    run = RunServices(cfg, "unused", None, tmp_path / "logs", said.append, Machine(gpus=0))
    return run.servers, said


def test_a_rerun_starts_with_the_size_last_asked_within_the_slots(tmp_path):
    run, _ = services(tmp_path, "inference.max_servers=3")
    assert run.first_size() == 1  # nothing asked: inference.num_servers
    ask_for_servers(run.storage, 3, by="test")
    assert run.first_size() == 3
    small, said = services(tmp_path, "inference.max_servers=2")  # a rerun placed for fewer
    assert small.first_size() == 2 and small.asked() == 2
    assert small.asked() == 2  # the health loop reads it every 5 s: said once, not each time
    assert said == [
        "fleet: 3 servers were asked but the plan has 2 slot(s) (inference.max_servers = 2); "
        "growing to 2"
    ]


def test_a_control_file_edited_by_hand_is_said_once_and_changes_nothing(tmp_path):
    run, said = services(tmp_path, "inference.max_servers=2")
    (tmp_path / "fleet" / "control").mkdir(parents=True)
    (tmp_path / "fleet" / FLEET_CONTROL).write_text('{"servers": "two"}')
    for _ in range(3):  # the health loop reads it every 5 s
        run.reconcile()
    assert run.first_size() == 1 and run.supervisors == [] and run._joining is None
    assert len(said) == 1 and "control/fleet.json holds" in said[0], said
    assert "rollflow scale RUN --servers N" in said[0]


def test_a_size_whose_joins_keep_failing_is_not_tried_forever(tmp_path, monkeypatch):
    run, said = services(tmp_path, "inference.max_servers=2")
    events = []
    monkeypatch.setattr(fleet_keeper, "publish", lambda storage, kind, **f: events.append(f))
    ask_for_servers(run.storage, 2, by="test")
    run._join_target = 2
    started = []
    run._begin_join = lambda: started.append(1)
    server1 = SimpleNamespace(name="vLLM server 1", index=1)
    for _ in range(3):
        run._join_failed(server1, "did not start", RuntimeError("no port"))
    run.reconcile()
    run.reconcile()
    stops = [line for line in said if "3 joins failed" in line]
    assert started == [] and len(stops) == 1, said
    assert [e["failed"] for e in events] == [1, 1, 1]
    ask_for_servers(run.storage, 3, by="test")  # another size: tried anew
    run.cfg.inference.max_servers = 3
    run.reconcile()
    assert started == [1]
