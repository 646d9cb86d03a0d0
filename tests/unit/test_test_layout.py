"""The suite's own layout: pytest imports test modules by basename (no packages), so two test
files of one name in different tiers break collection of the whole suite."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1]
