"""A broadcast of "the last finished step's weights" is queued at a step boundary: a re-join
that read the version between two steps met the next step's first optimizer step (409, and the
vLLM workers left waiting in their receive: found by the chaos campaign's fleet test)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from fastapi import HTTPException

from rollflow.trainer import protocol as p
from rollflow.trainer.api import TrainerAPI


class Queue:
    def __init__(self):
        self.commands = []

    def enqueue(self, command):
        self.commands.append(command)
        return command


def api(weights_version, num_steps=None):
    return TrainerAPI(
        SimpleNamespace(),
        SimpleNamespace(step=0),
        Queue(),
        [],
        backend="fsdp2",
        timeout_s=5,
        num_steps=num_steps,
        weights_version=weights_version,
    )


def test_a_trainer_restarted_from_the_last_steps_checkpoint_has_finished():
    """A node lost after the run's last step committed: the restarted trainer resumes from that
    step's checkpoint, where no /end_step will come; it says at once that training finished (the
    run waited for it and failed at its deadline)."""
    started = time.monotonic()
    done = api(weights_version=4, num_steps=4).training_finished(wait_s=5)
    assert done["finished"] and done["step"] == 4 and time.monotonic() - started < 1
    assert not api(weights_version=3, num_steps=4).training_finished()["finished"]
    assert not api(weights_version=0).training_finished()["finished"]  # no last step named


def test_a_broadcast_during_a_step_waits_for_its_end_and_goes_before_the_next():
    trainer = api(weights_version=None)  # step 4 is training
    threading.Timer(0.2, lambda: setattr(trainer, "weights_version", 4)).start()
    start = time.monotonic()
    version, command = trainer._queue_tagged(p.WEIGHTS_BROADCAST, None, wait_s=5)
    assert version == 4 and 0.15 < time.monotonic() - start < 2
    assert command == {"op": p.WEIGHTS_BROADCAST.op, "args": {"version": 4, "wait_s": 0.0}}


def test_without_a_wait_or_past_it_a_broadcast_during_a_step_is_refused():
    trainer = api(weights_version=None)
    for wait_s in (0.0, 0.2):
        with pytest.raises(HTTPException) as refused:
            trainer._queue_tagged(p.WEIGHTS_BROADCAST, None, wait_s=wait_s)
        assert refused.value.status_code == 409
    assert trainer.dispatcher.commands == []
    assert trainer._queue_tagged(p.WEIGHTS_BROADCAST, 7)[0] == 7  # an explicit version: at once
