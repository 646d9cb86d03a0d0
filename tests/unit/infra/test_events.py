"""Event names have one owner (infra/events.py): the record holds their plain strings."""

import json

from rollflow.infra.events import Event, has_event, publish
from rollflow.infra.storage import RunStorage


def test_events_are_recorded_by_their_names_and_found_again(tmp_path, monkeypatch):
    import prefect.events

    emitted = []  # the Prefect mirror, recorded here: a unit test reaches no Prefect API
    monkeypatch.setattr(prefect.events, "emit_event", lambda **kw: emitted.append(kw["event"]))
    storage = RunStorage(str(tmp_path), "events")
    publish(storage, Event.STEP_COMMITTED, step=1)
    assert not has_event(storage, Event.TRAINING_FINISHED)
    publish(storage, Event.TRAINING_FINISHED, step=1)
    lines = (tmp_path / "events" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["step_committed", "training_finished"]
    assert has_event(storage, Event.TRAINING_FINISHED)
    assert emitted == ["rollflow.step_committed", "rollflow.training_finished"]


def test_names_are_the_documented_ones():
    assert {e.value for e in Event} == {
        "run_started",
        "weights_published",
        "step_committed",
        "inference_restarted",
        "trainer_restarted",
        "fleet_changed",
        "training_finished",
    }
