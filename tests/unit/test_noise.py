"""Noise and precision (zerotune.core.noise): the comparison noise, ties, the precision tests and the bars, exactly."""
import math

import pytest

from zerotune.core.experiment import Status
from zerotune.core.noise import (
    can_beat,
    cannot_beat,
    comparison_noise,
    known_to_precision,
    must_beat,
    precise,
    replica_decides,
    resolvable,
    tie,
    typical_half_width,
    within_noise,
)
from zerotune.core.objective import OBJECTIVES
from zerotune.strategy.points import Point

THROUGHPUT, LATENCY = OBJECTIVES["throughput"], OBJECTIVES["latency"]


def test_comparison_noise_adds_the_intervals_and_the_run_to_run_noise_in_quadrature():
    # two single runs known to 2% and 1%, 1% run-to-run noise each (2% at 95%): sqrt(4 + 1 + 4 + 4) %
    assert comparison_noise([0.02, 0.01]) == pytest.approx(math.sqrt(0.0013))  # 3.6%
    # an unknown interval counts as the floor; a pooled point's run term shrinks with its runs
    assert comparison_noise([None, 0.01], [2, 1], floor=0.01) == pytest.approx(math.sqrt(0.0001 + 0.0002 + 0.0001 + 0.0004))


def test_the_noise_test_counts_the_larger_run_to_run_noise_of_the_two_points():
    # two runs known to +-1% each, 5% apart: beyond sqrt(2 x (1% ** 2 + (2 x 1%) ** 2)) = 3.2% with the assumed
    # 1% run-to-run noise, within sqrt(2 x (1% ** 2 + (2 x 4%) ** 2)) = 11.4% once the runs have shown 4%
    a, b = Point(16, Status.OK, 105.0, rel_half_width=0.01), Point(32, Status.OK, 100.0, rel_half_width=0.01)
    assert not within_noise(0.05, a, b, floor=0.01)
    assert within_noise(0.05, a, Point(32, Status.OK, 100.0, rel_half_width=0.01, run_noise=0.04), floor=0.01)
    assert not within_noise(0.115, a, Point(32, Status.OK, 100.0, rel_half_width=0.01, run_noise=0.04), 0.01)


def test_a_replica_runs_only_where_the_run_to_run_noise_blocks_a_decision_past_a_tie():
    # two runs known to +-1% each (+-1.41% together), 4% run-to-run noise (+-11.4% in all), 2% precision
    a, b = (Point(m, Status.OK, 100.0, rel_half_width=0.01, run_noise=0.04) for m in (16, 32))
    noise = math.sqrt(2 * (0.01 ** 2 + 0.08 ** 2))
    assert replica_decides(0.03, a, b, 0.01, 0.02)  # the other side reaches 8.4% past zero: a launch can decide
    assert replica_decides(-0.09, a, b, 0.01, 0.02)  # the interval still reaches 2.4% past zero
    assert not replica_decides(-(noise - 0.0199), a, b, 0.01, 0.02)  # at worst a tie: the reading stands
    assert replica_decides(-(noise - 0.0201), a, b, 0.01, 0.02)
    assert not replica_decides(0.0199, a, b, 0.01, 0.02)  # a tie
    assert not replica_decides(0.0139, a, b, 0.01, None)  # the runs' own intervals (1.41%) block: steps decide
    assert replica_decides(0.0142, a, b, 0.01, None)
    # the assumed 1% run-to-run noise (+-3.16% in all): a 3% difference could at most turn into a 0.16% one
    a, b = (Point(m, Status.OK, 100.0, rel_half_width=0.01) for m in (16, 32))
    assert not replica_decides(0.03, a, b, 0.01, 0.02)
    assert replica_decides(0.03, a, b, 0.01, 0.001)


def test_a_tie_is_a_difference_strictly_within_the_precision():
    assert tie(0.0199, 0.02) and tie(-0.0199, 0.02) and tie(0.0, 0.02)
    assert not tie(0.02, 0.02) and not tie(-0.02, 0.02)  # at the precision: not a tie
    assert not tie(0.021, 0.02) and not tie(-0.03, 0.02)
    assert not tie(0.0, None)  # no precision: never a tie


def test_the_bar_is_the_incumbents_pessimistic_bound_with_the_run_to_run_noise():
    # sqrt(hw^2 + (2 x 1%)^2 / runs + (2 x 1%)^2): the incumbent's interval and run term, the racer's run term
    assert must_beat(THROUGHPUT, 100.0, 0.03) == pytest.approx(100 * (1 - math.sqrt(0.0017)))  # 95.88
    assert must_beat(THROUGHPUT, 100.0, 0.03, runs=2) == pytest.approx(100 * (1 - math.sqrt(0.0015)))
    assert must_beat(LATENCY, 0.5, 0.02) == pytest.approx(0.5 * (1 + math.sqrt(0.0012)))  # 0.5173
    # a measured run-to-run noise of 4% (the tuning's estimate) lowers the bar: 100 - sqrt(0.0009 + 2 x 0.0064)
    assert must_beat(THROUGHPUT, 100.0, 0.03, run_noise=0.04) == pytest.approx(100 * (1 - math.sqrt(0.0137)))  # 88.3


def test_can_beat_only_beyond_the_precision():
    assert not can_beat(100.0, 80.0, 0.25)  # exactly 80 * 1.25: a tie
    assert can_beat(100.0 + 1e-9, 80.0, 0.25)
    assert not can_beat(100.0 - 1e-9, 80.0, 0.25)
    assert not can_beat(80.0, 80.0, 0.0)


def test_a_launch_resolves_only_a_gain_beyond_both_the_precision_and_its_noise():
    # the held-out GPT-2 (issue 52): mbs 8 read 3% under mbs 16, both known to ±8%; one more run known to ±8% and the
    # best read up to sqrt(0.08^2 + 0.08^2 + (2 * 0.01)^2 * 2) = 11.7% apart by noise alone
    noise = comparison_noise([0.08, 0.08])
    gain_high = -0.03 + noise  # what mbs 8 could truly beat 16 by
    assert round(noise, 4) == 0.1166 and not resolvable(gain_high, noise, 0.02)
    assert resolvable(0.05, 0.04, 0.02) and not resolvable(0.05, 0.05, 0.02) and not resolvable(0.02, 0.0, 0.02)
    assert resolvable(1e-9, 0.0, None)
    assert typical_half_width([0.05, None, 0.01, 0.03]) == 0.03 and typical_half_width([None]) is None


def test_a_run_is_precise_at_an_interval_within_the_precision_and_known_to_it_under_a_run_noise_as_narrow():
    assert precise(0.02, 0.02) and not precise(0.0201, 0.02) and not precise(None, 0.02)
    # +-2% at 95% from a 1% run-to-run sigma: exactly the precision, still known to it
    assert known_to_precision(0.015, 0.02, 0.01)
    assert not known_to_precision(0.015, 0.02, 0.0101)  # the run-to-run noise is wider than the precision
    assert not known_to_precision(0.025, 0.02, 0.01) and not known_to_precision(None, 0.02, 0.01)


def test_a_run_cannot_beat_the_bar_once_its_optimistic_bound_does_not_reach_it():
    # throughput 90 +-5%: at most 94.5; latency 0.5 s +-10%: at least 0.45 s
    assert cannot_beat(THROUGHPUT, 90.0, 0.05, 95.0) and not cannot_beat(THROUGHPUT, 90.0, 0.05, 94.0)
    assert cannot_beat(LATENCY, 0.5, 0.1, 0.44) and not cannot_beat(LATENCY, 0.5, 0.1, 0.46)
