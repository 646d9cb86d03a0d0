"""A step's schedule (flows/order.py): what it does and when the next step may train, one decision."""

from __future__ import annotations

import threading

import pytest

from rollflow.flows.order import Phase, StepOrder, StepSchedule
from rollflow.infra.config import load_config


def _cfg(*overrides: str):
    return load_config(
        None,
        [
            "model.path='unused'",
            "envs=[{name='add'}]",
            "run.num_steps=10",
            "run.eval_every=5",
            "run.checkpoint_every=4",
            *overrides,
        ],
    )


@pytest.mark.parametrize(
    ("step", "background", "releases_after", "captures"),
    [
        (1, True, Phase.TRAINED, True),  # the broadcast runs while the next step trains
        (1, False, Phase.SYNCED, False),  # the next step trains once vLLM has the weights
        (4, True, Phase.CHECKPOINTED, False),  # the checkpoint must see this step's weights
        (5, True, Phase.CHECKPOINTED, False),  # so must the evaluation
        (10, False, Phase.CHECKPOINTED, False),  # the last step does both
    ],
)
def test_when_a_step_releases_the_trainer(step, background, releases_after, captures):
    plan = StepSchedule.of(_cfg(f"trainer.background_sync={str(background).lower()}"), step)
    assert (plan.releases_after, plan.captures, plan.syncs) == (releases_after, captures, True)
    assert plan.checkpoints == (step % 4 == 0 or step == 10)
    assert plan.evaluates == (step % 5 == 0)


def test_a_step_that_does_not_sync_releases_the_trainer_once_trained():
    cfg = _cfg("train.sync_every=2", "train.max_staleness=1", "trainer.background_sync=false")
    plan = StepSchedule.of(cfg, 3)
    assert not plan.syncs and plan.releases_after is Phase.TRAINED and not plan.captures


def test_a_fractional_staleness_syncs_mid_step_except_where_the_step_evaluates():
    cfg = _cfg("train.max_staleness=0.5", "train.mini_batch_size=32")
    assert StepSchedule.of(cfg, 1).lag > 0
    assert StepSchedule.of(cfg, 1).releases_after is Phase.TRAINED
    assert not StepSchedule.of(cfg, 1).captures  # the mid-step sync sends what it kept
    assert StepSchedule.of(cfg, 5).lag == 0  # evaluation must see the step's whole weights


def test_the_trainer_is_released_at_the_scheduled_phase_only():
    cfg = _cfg("trainer.background_sync=false")
    order = StepOrder(cfg, resumed_from=0)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(order.wait_trainer(2, 30.0)))
    waiter.start()
    order.passed(1, Phase.TRAINED)  # step 1 releases after its sync: step 2 still waits
    waiter.join(0.2)
    assert waiter.is_alive()
    order.passed(1, Phase.SYNCED)
    waiter.join(5.0)
    assert not waiter.is_alive() and len(waited) == 1
    order.close()
    with pytest.raises(Exception, match="run closed: step 3 waited for step 2"):
        order.wait_trainer(3, 5.0)


@pytest.mark.parametrize("resumed_from", [0, 7])
def test_the_first_steps_flow_run_is_created_alone(monkeypatch, resumed_from):
    """The later steps' flow runs wait until the first step's flow trains: created at once, they
    began the first step's last (docs/performance.md, "Where a step's time goes")."""
    from rollflow.flows import train_step as step_flow

    first = resumed_from + 1
    order, began = StepOrder(_cfg(), resumed_from), []
    monkeypatch.setattr(step_flow, "train_step", lambda ctx, step, order, host: began.append(step))
    ctx = type("Ctx", (), {"config": _cfg()})()
    threads = [
        threading.Thread(target=step_flow.train_step_in_turn, args=(ctx, step, order, None))
        for step in range(first + 3, first - 1, -1)  # the later steps' threads first
    ]
    for t in threads:
        t.start()
    threads[-1].join(5.0)
    for t in threads[:-1]:
        t.join(0.2)
    assert began == [first] and all(t.is_alive() for t in threads[:-1])
    order.trains(first + 1)  # not the first step: nothing changes
    threads[0].join(0.2)
    assert began == [first]
    order.trains(first)
    for t in threads:
        t.join(5.0)
    assert sorted(began) == list(range(first, first + 4))


def test_a_flow_run_waiting_for_its_turn_ends_when_the_run_closes():
    order = StepOrder(_cfg(), resumed_from=0)
    order.close()
    with pytest.raises(Exception, match="run closed: step 2's flow run waited for step 1's flow"):
        order.wait_start_turn(2, 5.0)
    order.wait_start_turn(1, 5.0)  # the first never waits
