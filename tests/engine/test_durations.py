"""engine.durations: what the metrics export and what an engine worker publishes for routing,
in the same memory after a million events as after one."""
from __future__ import annotations

import sys

import pytest

from engine.durations import ADAPTER_LOAD_BUCKETS_S, Durations


def test_buckets_count_sum_and_a_mean_that_follows_a_change_of_workload():
    d = Durations(ADAPTER_LOAD_BUCKETS_S)
    assert d.mean_s is None and d.count == 0
    for s in (0.004, 0.005, 0.2, 99.0, -1.0):  # a clock step backwards counts as 0
        d.record(s)
    assert d.counts[0] == 3 and d.counts[ADAPTER_LOAD_BUCKETS_S.index(0.25)] == 1 and d.counts[-1] == 1
    assert d.count == sum(d.counts) == 5 and d.sum_s == pytest.approx(99.209)
    for _ in range(60):
        d.record(2.0)
    assert d.mean_s == pytest.approx(2.0, rel=0.01)  # the 99 s outlier is forgotten


def test_memory_stays_constant_however_many_events():
    d = Durations(ADAPTER_LOAD_BUCKETS_S)
    d.record(0.1)
    size = sys.getsizeof(d.counts) + sys.getsizeof(vars(d))
    for i in range(100_000):
        d.record(i % 7 * 0.01)
    assert sys.getsizeof(d.counts) + sys.getsizeof(vars(d)) == size and d.count == 100_001


def test_alpha_outside_its_range_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        Durations(alpha=0)
