"""A step's mini-batches: whole groups in order, or the step's samples in a seeded random order
(``train.mini_batch_split``), and the rank's selection of a mini-batch's rows from the batch."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from rollflow.infra.config import TrainSection
from rollflow.infra.errors import InputError
from rollflow.infra.storage import RunStorage
from rollflow.tasks.train.train_task import minibatches, sample_minibatches, split_seed
from rollflow.trainer.batches import BatchReader
from rollflow.trainer.protocol import CapturedReply

from trainer_support import forward_backward_reply, make_rows, optim_step_reply, write_batch

K4 = TrainSection(train_batch_size=32, mini_batch_size=8)


def keys(num_groups: int, group_size: int) -> list[tuple[int, int]]:
    return [(g, s) for g in range(num_groups) for s in range(group_size)]


def test_group_mini_batches_are_whole_groups_in_order():
    assert minibatches(list(range(10)), K4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert minibatches([3, 7], K4) == [[3], [7]]  # fewer groups than slices: fewer steps


def test_sample_mini_batches_hold_every_sample_once_in_near_equal_slices():
    all_keys = keys(13, 8)  # 104 samples into 4 slices
    parts = sample_minibatches(all_keys, K4, seed=5)
    assert len(parts) == 4
    assert sorted(len(p) for p in parts) == [26, 26, 26, 26]
    seen = Counter(k for p in parts for k in p)
    assert set(seen) == set(all_keys) and set(seen.values()) == {1}
    # Mixed: a slice holds samples of many groups, not whole groups.
    assert all(len({g for g, _ in p}) > 8 for p in parts)
    odd = sample_minibatches(keys(3, 3), K4, seed=0)  # 9 samples: 3, 2, 2, 2
    assert sorted(len(p) for p in odd) == [2, 2, 2, 3]
    assert len(sample_minibatches(keys(1, 2), K4, seed=0)) == 2  # fewer samples than slices


def test_sample_mini_batches_depend_on_the_seed_only():
    all_keys = keys(8, 8)
    assert sample_minibatches(all_keys, K4, 7) == sample_minibatches(list(all_keys), K4, 7)
    assert sample_minibatches(all_keys, K4, 7) != sample_minibatches(all_keys, K4, 8)
    assert split_seed(0, 3) != split_seed(1, 3) and split_seed(0, 3) != split_seed(0, 4)


@pytest.fixture
def ops(tmp_path):
    storage = RunStorage(str(tmp_path), "t")
    write_batch(storage, 1, make_rows(16, seed=3))  # 4 groups of 4 samples
    return BatchReader(storage, 0, 1, micro_batch_tokens=64, row_tokens=None)


def test_a_rank_takes_exactly_the_mini_batch_samples(ops):
    want = [(0, 1), (2, 0), (2, 3), (3, 2)]
    seqs = ops.sequences(1, [0, 2, 3], old_logprobs=False, samples=want)
    assert sorted(s.key for s in seqs) == want
    assert len(ops.sequences(1, [0, 2, 3], old_logprobs=False)) == 12  # no samples: the groups


def test_a_sample_the_batch_lacks_is_named(ops):
    with pytest.raises(InputError, match=r"no rows for samples \[\(1, 9\)\]"):
        ops.sequences(1, [0, 1], old_logprobs=False, samples=[(0, 0), (1, 9)])


class RecordingTrainer:
    """The train task's trainer calls, in order (no service: the order is what is tested)."""

    def __init__(self):
        self.calls: list[str] = []
        self.denominators: list[float | None] = []

    def forward_backward(self, step, groups, **kwargs):
        self.calls.append(f"fb{groups}")
        self.denominators.append(kwargs.get("num_loss_tokens"))
        return forward_backward_reply()

    def optim_step(self):
        self.calls.append("opt")
        return optim_step_reply()

    def weights_capture(self, version):
        self.calls.append(f"capture v{version}")
        return CapturedReply(version=version, capture_s=0.001, bytes=1)

    def end_step(self, step):
        self.calls.append("end")


@pytest.mark.parametrize(
    ("groups", "lag", "behind", "calls"),
    [
        # 4 optimizer steps, lag 1: kept after the 3rd, while the 4th trains.
        ([0, 1, 2, 3, 4, 5, 6, 7], 1, 1, "fb opt fb opt fb opt capture fb opt end"),
        ([0, 1, 2, 3, 4, 5, 6, 7], 3, 3, "fb opt capture fb opt fb opt fb opt end"),
        # Filters left 2 groups: 2 optimizer steps, fewer than the lag: kept before either.
        ([0, 5], 3, 2, "capture fb opt fb opt end"),
        ([], 1, 0, "capture end"),  # nothing kept: the weights are the previous step's end
    ],
)
def test_the_weights_are_kept_for_vllm_lag_optimizer_steps_before_the_steps_end(
    monkeypatch, groups, lag, behind, calls
):
    from rollflow.tasks.train import train_task as train_task

    recorder = RecordingTrainer()
    monkeypatch.setattr(train_task, "trainer_client", lambda ctx: recorder)
    train = TrainSection(train_batch_size=8, mini_batch_size=2, mini_batch_split="groups")
    config = SimpleNamespace(train=train)
    capture = train_task.MidStepCapture(lag)
    metrics = train_task.train.fn(
        SimpleNamespace(config=config), 5, groups, (), capture, num_loss_tokens=40
    )
    got = " ".join("fb" if c.startswith("fb") else c for c in recorder.calls)
    assert got == calls.replace("capture", "capture v5")
    assert capture.done.is_set() and capture.behind == behind and capture.capture_s == 0.001
    assert metrics["num_optim_steps"] == min(len(groups), 4)


@pytest.mark.parametrize(
    ("token_mean", "groups", "denominators"),
    [
        # Each mini-batch's own loss tokens, which the service counts.
        ("mini_batch", [0, 1, 2, 3, 4, 5, 6, 7], [None] * 4),
        # TRL's dapo: the batch's 90 loss tokens over its 4 mini-batches, in every one.
        ("batch", [0, 1, 2, 3, 4, 5, 6, 7], [22.5] * 4),
        ("batch", [0, 5], [45.0] * 2),  # filters left 2 groups: 2 mini-batches
    ],
)
def test_token_mean_sets_every_optimizer_steps_denominator(
    monkeypatch, token_mean, groups, denominators
):
    from rollflow.tasks.train import train_task as train_task

    recorder = RecordingTrainer()
    monkeypatch.setattr(train_task, "trainer_client", lambda ctx: recorder)
    train = TrainSection(
        train_batch_size=8, mini_batch_size=2, token_mean=token_mean, mini_batch_split="groups"
    )
    ctx = SimpleNamespace(config=SimpleNamespace(train=train))
    train_task.train.fn(ctx, 5, groups, (), num_loss_tokens=90)
    assert recorder.denominators == denominators


def test_mini_batch_defaults_to_the_whole_step():
    """A config that sets only train_batch_size (few keys: docs/guides/your-own-task.md) is
    valid: one optimizer step per weight sync, not a default of 64 above its batch."""
    from rollflow.infra.config import load_config

    assert TrainSection(train_batch_size=8).mini_batch_size == 8
    assert TrainSection().mini_batch_size == 64
    assert TrainSection(train_batch_size=8, mini_batch_size=2).optim_steps_per_step() == 4
    cfg = load_config(
        "configs/quickstart.toml", ["~train.mini_batch_size", "train.train_batch_size=16"]
    )
    assert cfg.train.mini_batch_size == 16
