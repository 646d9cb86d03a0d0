"""The staleness rule (infra/staleness.py): one owner, the same answer from either side."""

import pytest

from rollflow.infra.staleness import (
    STALENESS_EPS,
    allowed,
    newest_step,
    oldest_allowed_version,
    version_went_back,
    whole_steps,
)


@pytest.mark.parametrize(
    "S,whole", [(0, 0), (0.25, 0), (1, 1), (1.75, 1), (2, 2), (3 * (1 / 3), 1), (1 - 1e-9, 1)]
)
def test_whole_steps_rounds_only_within_eps(S, whole):
    assert whole_steps(S) == whole


def test_on_policy_takes_only_the_previous_version():
    assert allowed(4, step=5, max_staleness=0)
    assert not allowed(3.999, step=5, max_staleness=0)
    assert newest_step(4, 0) == 5


def test_fractional_bound_counts_optimizer_steps():
    # S = 1/4 with 4 optimizer steps a step: step 6 may take groups from step 5's weights 1/4 early.
    assert allowed(5 - 0.25, step=6, max_staleness=0.25)
    assert not allowed(5 - 0.5, step=6, max_staleness=0.25)
    assert allowed(1 / 3, step=2, max_staleness=2 / 3)  # rounding of thirds is allowed


@pytest.mark.parametrize("S", [0, 0.25, 1 / 3, 0.5, 1, 1.25, 2, 3.75])
@pytest.mark.parametrize("v", [0, 0.75, 1, 2 - 1 / 3, 4, 7.5])
def test_admission_and_emission_agree(S, v):
    """The producer admits a group for step N (N <= newest_step) exactly when the step may
    take it (allowed): the invariant seen from both sides."""
    for step in range(1, 15):
        assert allowed(v, step, S) == (step <= newest_step(v, S))
        assert (v >= oldest_allowed_version(step, S)) == allowed(v, step, S)


def test_version_going_back_ignores_rounding():
    assert version_went_back(2.0, 3.0)
    assert not version_went_back(3.0 - STALENESS_EPS / 2, 3.0)
    assert not version_went_back(3.25, 3.0)
