"""Per-environment moments merge exactly: any split of the values gives the whole's figures."""

import statistics

import pytest

from rollflow.infra.moments import PerEnvMoments


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
