"""run.keep_checkpoints: the checkpoint task keeps the last N committed checkpoints, removes the
older ones only after the new one's _SUCCESS, and never the one the trainer resumed from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollflow.infra.config import RunSection
from rollflow.infra.storage import SUCCESS, RunStorage
from rollflow.tasks.train import train_task


class SavingTrainer:
    """save_checkpoint as the trainer's rank 0 does it: the files, then the commit marker."""

    def __init__(self, storage: RunStorage):
        self.storage = storage

    def save_checkpoint(self, step: int) -> dict:
        folder = self.storage.step_dir("checkpoints", step)
        self.storage.fs.makedirs(folder, exist_ok=True)
        self.storage.fs.pipe(f"{folder}/model.safetensors", b"weights")
        self.storage.commit("checkpoints", step)
        return {"step": step}


def _run(tmp_path, monkeypatch, keep, resumed_from, steps, evals=None, best=True):
    """Checkpoint ``steps`` in turn; ``evals``: held-out reward by step, each step's metrics
    written after its checkpoint as the run does (None: no evaluation)."""
    storage = RunStorage(str(tmp_path), "run")
    monkeypatch.setattr(train_task, "trainer_client", lambda ctx: SavingTrainer(storage))
    ctx = SimpleNamespace(
        config=SimpleNamespace(run=RunSection(keep_checkpoints=keep, keep_best_checkpoint=best)),
        storage=storage,
        resumed_from=resumed_from,
    )
    for step in steps:
        train_task.checkpoint.fn(ctx, step)
        reward = (evals or {}).get(step)
        storage.write_metrics(step, {} if reward is None else {"eval_reward": reward})
    return storage


@pytest.mark.parametrize(
    ("keep", "resumed_from", "kept"),
    [
        (None, 0, [2, 4, 6, 8, 10]),  # today's behaviour: all
        (2, 0, [8, 10]),
        (1, 0, [10]),
        (2, 4, [4, 8, 10]),  # the trainer started from step 4: it stays
    ],
)
def test_the_last_n_and_the_resumed_one_are_kept(tmp_path, monkeypatch, keep, resumed_from, kept):
    storage = _run(tmp_path, monkeypatch, keep, resumed_from, [2, 4, 6, 8, 10])
    assert storage.committed_steps("checkpoints") == kept
    on_disk = {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()}
    assert on_disk == {f"step={s}" for s in kept}


def test_a_removal_cut_short_leaves_nothing_that_counts(tmp_path, monkeypatch):
    storage = _run(tmp_path, monkeypatch, None, 0, [1, 2, 3])
    fs = storage.fs
    real_rm = fs.rm

    def rm_marker_then_fail(path, recursive=False):
        if recursive:
            raise OSError("lost the host mid-removal")
        real_rm(path)

    monkeypatch.setattr(fs, "rm", rm_marker_then_fail)
    with pytest.raises(OSError):
        storage.keep_last("checkpoints", 1)
    assert not (tmp_path / "run" / "checkpoints" / "step=1" / SUCCESS).exists()
    assert (tmp_path / "run" / "checkpoints" / "step=1" / "model.safetensors").exists()
    assert storage.committed_steps("checkpoints") == [2, 3]


@pytest.mark.parametrize(
    ("best", "kept"),
    [(True, [4, 8, 10]), (False, [8, 10])],
)
def test_the_best_by_held_out_reward_is_kept_too(tmp_path, monkeypatch, best, kept):
    """run.keep_best_checkpoint: step 4's held-out reward is the best (0.9; step 8's 0.7, a tie
    of step 6's 0.9 is the later one, not kept), so its checkpoint stays beside the last two."""
    evals = {2: 0.5, 4: 0.9, 6: 0.9, 8: 0.7, 10: float("nan")}
    storage = _run(tmp_path, monkeypatch, 2, 0, [2, 4, 6, 8, 10], evals, best=best)
    assert storage.committed_steps("checkpoints") == kept
