"""The ranks' metric helpers (the moments both sides share: tests/unit/infra/test_moments.py)."""

import math

import pytest

from rollflow.trainer.metrics import effective_sample_size


def test_ess_is_one_for_equal_weights_and_small_for_one_dominant():
    assert effective_sample_size(4.0, 4.0, 4) == pytest.approx(1.0)
    assert effective_sample_size(10.0 + 3e-3, 100.0 + 3e-6, 4) == pytest.approx(0.25, rel=1e-3)
    assert math.isnan(effective_sample_size(0.0, 0.0, 0))
