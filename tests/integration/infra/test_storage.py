import json

import pyarrow as pa
import pytest

from rollflow.infra.storage import RunStorage, StorageError


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return RunStorage(str(tmp_path), "run1")
    url = request.getfixturevalue("s3_endpoint")
    return RunStorage(
        f"s3://rollflow/{tmp_path.name}",
        "run1",
        {"endpoint_url": url, "key": "testing", "secret": "testing"},
    )


def _table(n: int) -> pa.Table:
    return pa.table({"step": list(range(n)), "reward": [float(i) for i in range(n)]})


def test_write_commit_read_round_trip(storage):
    uri = storage.write_step_table("rollouts", 3, _table(5))
    assert uri.endswith("/run1/rollouts/step=3")
    assert storage.committed_steps("rollouts") == [3]
    assert storage.read_step_table("rollouts", 3).num_rows == 5


def test_unmarked_folder_is_never_read_and_is_replaced(storage):
    folder = storage.step_dir("rollouts", 1)
    storage.fs.makedirs(folder, exist_ok=True)
    storage.fs.pipe_file(f"{folder}/part-0.parquet", b"half-written garbage")
    assert storage.committed_steps("rollouts") == []
    with pytest.raises(StorageError, match="not committed"):
        storage.read_step_table("rollouts", 1)
    storage.write_step_table("rollouts", 1, _table(2))
    assert storage.read_step_table("rollouts", 1).num_rows == 2


def test_committed_step_is_not_overwritten(storage):
    storage.write_step_table("batches", 2, _table(1))
    with pytest.raises(StorageError, match="already committed"):
        storage.write_step_table("batches", 2, _table(1))
    storage.remove_step("batches", 2)
    assert storage.committed_steps("batches") == []


def test_metrics_and_events(storage):
    storage.write_metrics(2, {"reward_mean": 0.5})
    storage.write_metrics(10, {"reward_mean": 0.7})
    assert [r["step"] for r in storage.read_metrics()] == [2, 10]
    storage.append_event("step_committed", step=1)
    storage.append_event("training_finished", step=2)
    assert [e["event"] for e in storage.read_events()] == ["step_committed", "training_finished"]


def test_events_on_an_object_store_append_in_constant_size(s3_endpoint, tmp_path, monkeypatch):
    """Each append PUTs one segment of at most EVENTS_PER_SEGMENT lines, whatever the run's
    length; the events read back in order, also after a new process resumes the last segment."""
    from rollflow.infra import storage as storage_mod

    opts = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    store = RunStorage(f"s3://rollflow/{tmp_path.name}", "events", opts)
    written: list[int] = []
    real_pipe = store.fs.pipe_file
    monkeypatch.setattr(
        store.fs,
        "pipe_file",
        lambda path, data, **kw: (written.append(len(data)), real_pipe(path, data, **kw)),
    )
    per = storage_mod.EVENTS_PER_SEGMENT
    num = 3 * per + 5
    for i in range(num):
        store.append_event("step_committed", step=i)
    assert [e["step"] for e in store.read_events()] == list(range(num))
    assert store.fs.exists(store.path("events.jsonl")) is False
    segments = store._event_segments()
    assert [p.rsplit("/", 1)[1] for p in segments] == [f"part-{i:06d}.jsonl" for i in range(4)]
    line = written[0]
    assert max(written) <= per * (line + 8), "an append rewrote more than one segment"
    assert written[-1] <= 5 * (line + 8)  # the 5th line of the 4th segment
    # A new process (no segment in memory) continues the last segment, then starts the next.
    storage_mod._SEGMENTS.clear()
    again = RunStorage(f"s3://rollflow/{tmp_path.name}", "events", opts)
    for i in range(num, num + per):
        again.append_event("step_committed", step=i)
    assert [e["step"] for e in again.read_events()] == list(range(num + per))
    assert len(again._event_segments()) == 5


def test_events_of_an_older_version_on_an_object_store_are_read_first(s3_endpoint, tmp_path):
    opts = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    store = RunStorage(f"s3://rollflow/{tmp_path.name}", "old", opts)
    store.fs.pipe_file(store.path("events.jsonl"), b'{"event": "run_started"}\n')
    store.append_event("step_committed", step=1)
    assert [e["event"] for e in store.read_events()] == ["run_started", "step_committed"]


def test_torn_event_line_is_skipped(tmp_path):
    storage = RunStorage(str(tmp_path), "r")
    storage.append_event("a")
    with open(storage.path("events.jsonl"), "a") as fh:
        fh.write('{"event": "b", "ti')
    assert [e["event"] for e in storage.read_events()] == ["a"]


def test_upload_dir_and_local_copy(storage, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "config.json").write_text("{}")
    (src / "trainer").mkdir()
    (src / "trainer" / "state.json").write_text("{}")
    storage.upload_dir(src, "checkpoints", 4)
    assert storage.committed_steps("checkpoints") == [4]
    local = storage.local_copy("checkpoints", 4, tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == b"weights"
    assert (local / "trainer" / "state.json").read_text() == "{}"


def test_a_local_copy_follows_a_new_commit_at_the_same_uri(storage, tmp_path):
    """A run deleted and started again under the same name (or another endpoint with the same
    bucket) commits new files at the same URI: the cached copy of the old commit is not reused."""
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"old weights")
    storage.upload_dir(src, "checkpoints", 2)
    assert (
        storage.local_copy("checkpoints", 2, tmp_path / "cache") / "model.safetensors"
    ).read_bytes() == b"old weights"
    storage.fs.rm(storage.step_dir("checkpoints", 2), recursive=True)
    (src / "model.safetensors").write_bytes(b"new weights")
    storage.upload_dir(src, "checkpoints", 2)
    local = storage.local_copy("checkpoints", 2, tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == b"new weights"


def test_a_json_file_rewritten_while_it_is_read_is_read_whole(s3_endpoint, tmp_path, monkeypatch):
    """A control file (a trainer node's address) is read by one process as another rewrites it:
    the reader gets the old or the new file whole. The rewrite lands just after the reader's
    HEAD, where s3fs's file object had fixed the ETag its reads must match (CI failed a two-host
    run there: ``FileExpired``)."""
    storage = RunStorage(
        f"s3://rollflow/{tmp_path.name}",
        "run1",
        {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"},
    )
    storage.write_json("control/trainer/node-0.json", {"address": "192.0.2.1", "port": 1})
    fs, target = storage.fs, storage.path("control/trainer/node-0.json")
    new = {"address": "192.0.2.2", "port": 22222, "restarted": True}
    info, info_async = fs.info, fs._info
    rewrites = []

    def after_head(path, **kwargs):
        found = info(path, **kwargs)
        if not rewrites:
            rewrites.append(1)
            storage.write_json("control/trainer/node-0.json", new)
        return found

    async def after_head_async(path, **kwargs):
        found = await info_async(path, **kwargs)
        if not rewrites:
            rewrites.append(1)
            await fs._pipe_file(target, json.dumps(new, indent=2, sort_keys=True).encode())
        return found

    monkeypatch.setattr(fs, "info", after_head)
    monkeypatch.setattr(fs, "_info", after_head_async)
    assert storage.read_json("control/trainer/node-0.json") in (
        {"address": "192.0.2.1", "port": 1},
        new,
    )
    assert rewrites, "the rewrite never landed between the HEAD and the read"
    assert storage.read_json("control/trainer/node-0.json") == new
