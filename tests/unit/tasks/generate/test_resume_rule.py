"""The one resume rule for committed future-step rollouts, at several staleness bounds."""

import pytest

from rollflow.infra.config import load_config
from rollflow.infra.context import RunContext
from rollflow.infra.http import Endpoint
from rollflow.infra.schema import rows_to_table
from rollflow.tasks.generate.generate_task import reusable_rollouts, reused_steps


def _ctx(tmp_path, max_staleness: float) -> RunContext:
    cfg = load_config(
        "configs/quickstart.toml",
        [
            f"run.storage={tmp_path}",
            f"train.max_staleness={max_staleness}",
            "train.train_batch_size=128",
            "train.mini_batch_size=32",  # 4 optimizer steps per step: fractions of 1/4 exist
        ],
    )
    ep = Endpoint("x", "http://127.0.0.1:1", "t")
    return RunContext(config=cfg, model_path="unused", trainer=ep, inference=[ep])


def _commit(ctx: RunContext, step: int, version: float) -> None:
    row = {
        "run": "r",
        "step": step,
        "group_index": 0,
        "sample_index": 0,
        "version_started": version,
        "version_finished": version,
    }
    ctx.storage.write_step_table("rollouts", step, rows_to_table([row]))


@pytest.mark.parametrize(
    ("max_staleness", "step", "version", "resumed_from", "reused"),
    [
        (0, 3, 2, 2, True),  # on-policy: step C+1 sampled by version C
        (0, 4, 3, 2, False),  # sampled by a version the resumed trainer never had
        (1, 4, 2, 2, True),  # one step off: version C still fresh enough for step C+2
        (1, 5, 2, 2, False),  # too stale for step C+3
        (2, 5, 2, 2, True),
        # Versions sent mid-step: 1.75 is step 2's weights less its last optimizer step.
        (0.25, 3, 1.75, 2, True),  # step C+1 sampled by step C's mid-step weights
        (0.25, 3, 1.5, 2, False),  # two optimizer steps behind: past the bound of one
        (0.25, 4, 2.75, 2, False),  # step C+1's mid-step weights: lost with the resume
        (1.25, 4, 1.75, 2, True),
    ],
)
def test_committed_rollouts_reused_only_within_the_bound(
    tmp_path, max_staleness, step, version, resumed_from, reused
):
    ctx = _ctx(tmp_path, max_staleness)
    _commit(ctx, step, version)
    assert reusable_rollouts(ctx, step, resumed_from) == reused


def test_uncommitted_rollouts_are_never_reused(tmp_path):
    ctx = _ctx(tmp_path, 0)
    assert reusable_rollouts(ctx, 1, 0) is False


def test_only_the_consecutive_qualifying_steps_after_the_checkpoint_are_reused(tmp_path):
    """S = 2, resumed from C = 2: step 3 qualifies; step 4 was sampled by a version the resumed
    trainer never had, so it and everything after it is generated again, even step 5, which
    would qualify on its own (the producer feeds the steps after the reused ones in order)."""
    ctx = _ctx(tmp_path, 2)
    for step, version in [(3, 2), (4, 3), (5, 2)]:
        _commit(ctx, step, version)
    assert reusable_rollouts(ctx, 5, 2)
    assert reused_steps(ctx, 2) == [3]
    ctx.storage.remove_step("rollouts", 4)
    _commit(ctx, 4, 2)
    assert reused_steps(ctx, 2) == [3, 4, 5]
