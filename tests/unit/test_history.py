"""The status page's percentiles (quilld/http/history.py): read off bucket counts as
Prometheus's histogram_quantile does, linearly inside the bucket the rank falls in."""

from __future__ import annotations

import pytest

from quilld.http.history import quantile

INF = float("inf")


def test_a_quantile_is_interpolated_inside_its_bucket():
    bounds = [0.001, 0.01, 0.1, INF]
    # 10 observations up to 1 ms, 10 in (1 ms, 10 ms]: the median is the first bucket's top
    assert quantile(0.5, bounds, [10, 10, 0, 0]) == pytest.approx(0.001)
    assert quantile(0.75, bounds, [10, 10, 0, 0]) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(0.25, bounds, [10, 10, 0, 0]) == pytest.approx(0.0005)  # from 0 to the first bound
    assert quantile(0.99, bounds, [0, 0, 100, 0]) == pytest.approx(0.01 + 0.09 * 0.99)


def test_beyond_the_last_bound_the_last_bound_is_all_that_is_known():
    assert quantile(0.99, [0.001, 0.01, INF], [1, 0, 99]) == 0.01


def test_no_observation_no_quantile():
    assert quantile(0.5, [0.001, INF], [0, 0]) is None
