"""Bootstrap intervals against cases computed by hand: the resampled mean of a few 0/1 values follows a binomial
distribution, so its percentiles are known exactly."""

import math

import pytest

import artnb as art
from artnb.core.intervals import bootstrap_mean


def test_two_values_give_the_whole_range():
    # resampled means of [0, 1]: 0, 0.5, 1 with chances 1/4, 1/2, 1/4 -> the 2.5% and 97.5% points are 0 and 1
    interval = bootstrap_mean([0.0, 1.0])
    assert (interval.mean, interval.low, interval.high) == (0.5, 0.0, 1.0)
    assert str(interval) == "+0.500 [+0.000, +1.000]"


def test_one_in_four_matches_the_binomial_percentiles():
    # ones drawn in 4 picks ~ Binomial(4, 1/4): P(0) = 0.316, P(<=2) = 0.949, P(<=3) = 0.996,
    # so the 2.5% point is 0/4 and the 97.5% point is 3/4
    interval = bootstrap_mean([0, 0, 0, 1])
    assert (interval.low, interval.high) == (0.0, 0.75)
    assert interval.n == 4 and interval.runs == 1


def test_a_constant_has_no_width_and_excludes_everything_else():
    interval = bootstrap_mean([0.3] * 6)
    assert interval.low == interval.high == pytest.approx(0.3)
    assert interval.excludes(0.0) and not interval.excludes(0.3)


def test_runs_that_disagree_widen_the_interval_to_what_the_runs_allow():
    values = [0.0] * 8 + [1.0] * 8
    pooled = bootstrap_mean(values)
    by_run = bootstrap_mean(values, runs=["a"] * 8 + ["b"] * 8)
    # each run is constant, so only the draw of runs varies: means 0, 0.5, 1 with chances 1/4, 1/2, 1/4
    assert (by_run.low, by_run.high, by_run.runs) == (0.0, 1.0, 2)
    # treated as 16 independent scenarios the same values look far more certain
    assert 0.2 < pooled.low < 0.5 < pooled.high < 0.8


def test_a_large_sample_agrees_with_the_normal_interval():
    values = [float(i % 7) for i in range(700)]
    interval = bootstrap_mean(values)
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = 1.96 * sd / math.sqrt(len(values))
    assert interval.low == pytest.approx(mean - half, abs=0.03)
    assert interval.high == pytest.approx(mean + half, abs=0.03)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="1 of 3 values are NaN"):
        bootstrap_mean([1.0, math.nan, 2.0])
    with pytest.raises(ValueError, match="one run label per value"):
        bootstrap_mean([1.0, 2.0], runs=["a"])
    with pytest.raises(ValueError, match="confidence=95"):
        bootstrap_mean([1.0, 2.0], confidence=95)
    assert art.bootstrap_mean is bootstrap_mean
