"""Event names have one owner (infra/events.py): the record holds their plain strings."""

import json

from rollflow.infra.events import Event, has_event, publish
from rollflow.infra.storage import RunStorage


def mirrored(monkeypatch) -> list[str]:
    """The Prefect mirror's events, recorded here: a unit test reaches no Prefect API."""
    import prefect.events

    emitted: list[str] = []
    monkeypatch.setattr(prefect.events, "emit_event", lambda **kw: emitted.append(kw["event"]))
    return emitted


def test_events_are_recorded_by_their_names_and_found_again(tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    emitted = mirrored(monkeypatch)
    storage = RunStorage(str(tmp_path), "events")
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        publish(storage, Event.STEP_COMMITTED, step=1)
        assert not has_event(storage, Event.TRAINING_FINISHED)
        publish(storage, Event.TRAINING_FINISHED, step=1)
    lines = (tmp_path / "events" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["step_committed", "training_finished"]
    assert has_event(storage, Event.TRAINING_FINISHED)
    assert emitted == ["rollflow.step_committed", "rollflow.training_finished"]


def test_without_a_prefect_api_the_event_is_recorded_and_not_mirrored(tmp_path, monkeypatch):
    """Prefect's emit_event, called where no API is configured, starts an ephemeral API server
    of its own (seen in the suite: the fleet test's worker process, two per run): nothing to
    hear the event there, so it is only recorded."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    emitted = mirrored(monkeypatch)
    storage = RunStorage(str(tmp_path), "events")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        publish(storage, Event.FLEET_CHANGED, servers=2)
    assert [e["event"] for e in storage.read_events()] == ["fleet_changed"]
    assert emitted == []


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
