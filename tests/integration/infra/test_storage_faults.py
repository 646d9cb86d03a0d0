"""S3 errors injected between RunStorage and moto's server: retried, and nothing half-written is read.

A fault proxy (``rollflow.testing.fault_proxy``) sits in front of moto and answers 500 / 503,
or drops the connection before or after forwarding, on chosen requests. What the run wrote is
then read back directly from moto, past the proxy, as a rerun would find it.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from rollflow.infra.storage import RunStorage, StorageError
from rollflow.testing.fault_proxy import FAULTS, FaultProxy, random_faults

pytestmark = pytest.mark.chaos
SEED = int(os.environ.get("ROLLFLOW_CHAOS_SEED", "6"))
# Fewer tries than botocore's default 5, so that exhausting them is quick.
FEW_RETRIES = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}


class Breakable:
    """A fault plan: requests whose path ends with a broken suffix fail on every try."""

    def __init__(self):
        self.broken: dict[tuple[str, str], str] = {}

    def __call__(self, method: str, path: str, attempt: int) -> str:
        for (m, suffix), fault in self.broken.items():
            if m == method and path.endswith(suffix):
                return fault
        return "ok"


def storage(tmp_path, endpoint: str, **options) -> RunStorage:
    # A fresh filesystem object each time: no listing cache shared with another view.
    return RunStorage(
        f"s3://rollflow/{tmp_path.name}",
        "run",
        {"endpoint_url": endpoint, "skip_instance_cache": True, **options},
    )


def rollouts(step: int, tag: str = "") -> pa.Table:
    return pa.table(
        {
            "step": [step] * 16,
            "group_index": list(range(16)),
            "completion_text": [f"{tag}{step}-{i}" for i in range(16)],
        }
    )


@pytest.fixture
def checkpoint_dir(tmp_path):
    src = tmp_path / "ckpt"
    (src / "trainer").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "trainer" / "state.json").write_text('{"step": 1}')
    return src


def same_files(a, b) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "_SUCCESS")
    return files == sorted(
        p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != "_SUCCESS"
    ) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_transient_s3_faults_are_retried_and_every_file_lands_whole(
    s3_endpoint, tmp_path, checkpoint_dir
):
    """A quarter of GET/PUT/HEAD requests fail (500, 503, dropped before or after the write),
    at most twice in a row per object; s3fs/botocore's default retries carry every write."""
    with FaultProxy(s3_endpoint, random_faults(0.25, seed=SEED)) as proxy:
        flaky = storage(tmp_path, proxy.url)
        for step in range(1, 5):
            flaky.write_step_table("rollouts", step, rollouts(step))
            flaky.write_metrics(step, {"reward_mean": step / 10})
            flaky.upload_dir(checkpoint_dir, "checkpoints", step)
            flaky.append_event("step_committed", step=step)
            assert flaky.read_step_table("rollouts", step).equals(rollouts(step))
        cached = flaky.local_copy("checkpoints", 4, tmp_path / "cache")
    print(
        f"seed {SEED}: {sum(proxy.injected.values())} faults in {sum(proxy.attempts.values())} "
        f"requests: {dict(proxy.injected)}"
    )
    assert set(proxy.injected) == set(FAULTS)  # every kind was injected, and survived
    direct = storage(tmp_path, s3_endpoint)  # what a rerun finds, past the proxy
    for kind in ("rollouts", "checkpoints"):
        assert direct.committed_steps(kind) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert direct.read_step_table("rollouts", step).equals(rollouts(step))
    assert [r["reward_mean"] for r in direct.read_metrics()] == [0.1, 0.2, 0.3, 0.4]
    assert [e["step"] for e in direct.read_events()] == [1, 2, 3, 4]  # each event once, none lost
    assert same_files(checkpoint_dir, direct.local_copy("checkpoints", 2, tmp_path / "cache2"))
    assert same_files(checkpoint_dir, cached)


def test_a_step_whose_upload_failed_is_never_read_as_committed_and_is_redone(
    s3_endpoint, tmp_path, checkpoint_dir
):
    plan = Breakable()
    with FaultProxy(s3_endpoint, plan) as proxy:
        flaky = storage(tmp_path, proxy.url, **FEW_RETRIES)
        flaky.write_step_table("rollouts", 1, rollouts(1))
        # Step 2's data lands, its marker never does: the commit failed, the step is not there.
        plan.broken["PUT", "rollouts/step=2/_SUCCESS"] = "500"
        with pytest.raises(StorageError, match=r"rollouts/step=2/_SUCCESS"):
            flaky.write_step_table("rollouts", 2, rollouts(2, "old"))
        # A checkpoint whose weights file cannot be uploaded is not committed either.
        plan.broken["PUT", "checkpoints/step=2/model.safetensors"] = "500"
        with pytest.raises(StorageError, match=r"model\.safetensors"):
            flaky.upload_dir(checkpoint_dir, "checkpoints", 2)

        rerun = storage(tmp_path, s3_endpoint)
        assert rerun.fs.exists(f"{rerun.step_dir('rollouts', 2)}/part-0.parquet")  # half-written
        assert rerun.committed_steps("rollouts") == [1]
        assert rerun.committed_steps("checkpoints") == []
        with pytest.raises(StorageError, match="not committed"):
            rerun.read_step_table("rollouts", 2)
        with pytest.raises(StorageError, match="not committed"):
            rerun.local_copy("checkpoints", 2, tmp_path / "cache")

        # The endpoint heals; the rerun writes the steps again, replacing the half-written folders.
        plan.broken.clear()
        flaky.write_step_table("rollouts", 2, rollouts(2, "new"))
        flaky.upload_dir(checkpoint_dir, "checkpoints", 2)
    rerun = storage(tmp_path, s3_endpoint)  # the next run's fresh view
    assert rerun.read_step_table("rollouts", 2).equals(rollouts(2, "new"))
    assert rerun.fs.ls(rerun.step_dir("rollouts", 2), detail=False) == [
        f"{rerun.step_dir('rollouts', 2)}/{name}" for name in ("_SUCCESS", "part-0.parquet")
    ]
    assert same_files(checkpoint_dir, rerun.local_copy("checkpoints", 2, tmp_path / "cache"))


def test_a_checkpoint_copy_cut_by_a_read_error_is_copied_again(
    s3_endpoint, tmp_path, checkpoint_dir
):
    """The local copy of a committed checkpoint (what a resumed run loads) is whole or absent."""
    plan = Breakable()
    with FaultProxy(s3_endpoint, plan) as proxy:
        flaky = storage(tmp_path, proxy.url, **FEW_RETRIES)
        flaky.upload_dir(checkpoint_dir, "checkpoints", 1)
        plan.broken["GET", "checkpoints/step=1/trainer/state.json"] = "500"  # copied last
        cache = tmp_path / "cache"
        with pytest.raises(StorageError, match="state.json"):
            flaky.local_copy("checkpoints", 1, cache)
        (copy,) = cache.iterdir()  # one folder per step URI
        assert (copy / "model.safetensors").exists() and not (copy / "_SUCCESS").exists()
        plan.broken.clear()
        assert same_files(checkpoint_dir, flaky.local_copy("checkpoints", 1, cache))
        assert (copy / "_SUCCESS").exists()
