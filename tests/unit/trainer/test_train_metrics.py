import math
import statistics

import pytest

from rollflow.trainer.metrics import (
    PerEnvMoments,
    effective_sample_size,
    summarize_optimizer_steps,
)


def test_moments_merged_in_any_split_equal_the_whole():
    values = [("a", 0.5), ("b", 2.0), ("a", 1.5), ("b", -1.0), ("a", 4.0)]
    whole = PerEnvMoments()
    for env, v in values:
        whole.add("x", env, v)
    parts = PerEnvMoments()
    for chunk in (values[:2], values[2:]):
        p = PerEnvMoments()
        for env, v in chunk:
            p.add("x", env, v)
        parts.merge_json(p.to_json())
    flat = parts.flat()
    assert flat == pytest.approx(whole.flat())
    a = [v for e, v in values if e == "a"]
    assert flat["x/a/mean"] == pytest.approx(statistics.fmean(a))
    assert flat["x/a/std"] == pytest.approx(statistics.pstdev(a))
    assert flat["x/a/max"] == 4.0 and flat["x/all/max"] == 4.0
    assert list(flat)[:3] == ["x/all/mean", "x/all/std", "x/all/max"]


def test_ess_is_one_for_equal_weights_and_small_for_one_dominant():
    assert effective_sample_size(4.0, 4.0, 4) == pytest.approx(1.0)
    assert effective_sample_size(10.0 + 3e-3, 100.0 + 3e-6, 4) == pytest.approx(0.25, rel=1e-3)
    assert math.isnan(effective_sample_size(0.0, 0.0, 0))


def test_step_summary_is_flat_floats_with_tokens_per_second():
    per_env = PerEnvMoments()
    per_env.add("entropy", "sort", 1.0)
    result = {
        "loss": 0.5,
        "grad_norm": 2.0,
        "clip_fraction": 0.1,
        "entropy": 1.0,
        "mismatch_kl": 0.01,
        "ess": 0.9,
        "kl": 0.0,
        "tis_weight": 1.0,
        "lr": 1e-4,
        "num_loss_tokens": 10,
        "num_tokens": 30,
        "forward_backward_s": 0.2,
        "optim_step_s": 0.1,
        "per_env": per_env.to_json(),
    }
    out = summarize_optimizer_steps([result, {**result, "loss": 1.5}])
    assert out["loss"] == 1.0 and out["num_optim_steps"] == 2 and out["num_tokens"] == 60
    assert out["tokens_per_s"] == pytest.approx(60 / 0.6)
    assert out["entropy/sort/mean"] == 1.0 and out["entropy/all/max"] == 1.0
    assert all(isinstance(v, (int, float)) for v in out.values())
