"""The throughput model (zerotune/model/throughput.py): exact bounds on known affine curves."""
import pytest

from zerotune.model.throughput import Bounds, Reading, bounds, ceiling, per_sample_floor

EXACT = 1e-9


def on_curve(a: float, b: float, mbs: int, half_width: float = 0.0) -> Reading:
    """The reading of tau(m) = a + b * m at ``mbs``: throughput = mbs / tau."""
    return Reading(mbs=mbs, throughput=mbs / (a + b * mbs), half_width=half_width)


def low_high(b: Bounds) -> tuple[float, float]:
    return b.low, b.high


def test_exact_affine_readings_pin_the_curve_everywhere():
    readings = [on_curve(0.5, 0.1, 4), on_curve(0.5, 0.1, 16)]  # tau(4) = 0.9 s, tau(16) = 2.1 s
    for mbs, tau in ((8, 1.3), (32, 3.7), (2, 0.7)):
        got = bounds(readings, mbs)
        assert got.mbs == mbs
        assert got.low == pytest.approx(mbs / tau, rel=EXACT)
        assert got.high == pytest.approx(mbs / tau, rel=EXACT)


def test_two_noisy_readings_bound_an_extrapolation_by_the_extreme_lines():
    # tau(4) = 0.9 s and tau(16) = 2.1 s at h = 0.02: tau(4) in [0.9/1.02, 0.9/0.98], tau(16) in
    # [2.1/1.02, 2.1/0.98]. On a line, tau(32) = tau(16) + (16/12) (tau(16) - tau(4)) = (7/3) tau(16) - (4/3) tau(4).
    # Slowest: the vertex tau(16) = 2.1/0.98 = 15/7, tau(4) = 0.9/1.02 = 15/17 (b = 0.10504, a = 0.46218 >= 0):
    #   tau(32) = 5 - 20/17 = 65/17, low = 32 * 17/65 = 544/65 samples/s.
    # Fastest: the vertex tau(16) = 2.1/1.02 = 35/17, tau(4) = 0.9/0.98 = 45/49 (b = 0.09504, a = 0.53822 >= 0):
    #   tau(32) = 245/51 - 60/49 = 8945/2499, high = 32 * 2499/8945 = 79968/8945 samples/s.
    readings = [on_curve(0.5, 0.1, 4, 0.02), on_curve(0.5, 0.1, 16, 0.02)]
    got = bounds(readings, 32)
    assert got.low == pytest.approx(544 / 65, rel=EXACT)
    assert got.high == pytest.approx(79968 / 8945, rel=EXACT)
    assert got.low < 32 / 3.7 < got.high  # the true curve's 8.6486 samples/s


def test_one_reading_scales_perfectly_above_and_is_flat_below():
    readings = [Reading(mbs=8, throughput=100.0, half_width=0.02)]
    assert low_high(bounds(readings, 16)) == pytest.approx((98.0, 204.0), rel=EXACT)
    assert low_high(bounds(readings, 8)) == pytest.approx((98.0, 102.0), rel=EXACT)
    assert low_high(bounds(readings, 2)) == pytest.approx((24.5, 102.0), rel=EXACT)


def test_the_polygon_is_bounded_so_low_is_never_zero():
    """The brief expected low = 0 above a single reading (tau unbounded); a >= 0 and b >= 0 bound it:
    at mbs 1024 the slowest curve is all fixed work, the reading's low end, 98 samples/s."""
    got = bounds([Reading(mbs=8, throughput=100.0, half_width=0.02)], 1024)
    assert got.low == pytest.approx(98.0, rel=EXACT)
    assert got.high == pytest.approx(102.0 * 128, rel=EXACT)


def test_a_half_width_over_half_is_clamped_to_half():
    got = bounds([Reading(mbs=8, throughput=100.0, half_width=0.9)], 8)
    assert (got.low, got.high) == pytest.approx((50.0, 150.0), rel=EXACT)


def test_a_throughput_falling_beyond_the_noise_fits_no_curve():
    readings = [Reading(mbs=4, throughput=100.0, half_width=0.02), Reading(mbs=8, throughput=90.0, half_width=0.02)]
    assert bounds(readings, 16) is None
    assert per_sample_floor(readings) is None
    assert ceiling(readings) is None
    assert bounds([], 16) is None


def test_a_throughput_falling_within_the_noise_fits_and_a_larger_mbs_is_never_slower():
    # tau(8) <= 2 tau(4) (a >= 0) caps tau(8) at 8/98: the low end at mbs 8 is mbs 4's low end, 98, above the
    # reading's own 97 * 0.98; the high end is the reading's, 97 * 1.02.
    readings = [Reading(mbs=4, throughput=100.0, half_width=0.02), Reading(mbs=8, throughput=97.0, half_width=0.02)]
    got = bounds(readings, 8)
    assert (got.low, got.high) == pytest.approx((98.0, 98.94), rel=EXACT)


def test_per_sample_floor_and_ceiling():
    exact = [on_curve(0.5, 0.1, 4), on_curve(0.5, 0.1, 16)]
    assert per_sample_floor(exact) == pytest.approx(0.1, rel=EXACT)
    assert ceiling(exact) == pytest.approx(10.0, rel=EXACT)
    # At h = 0.02 the flattest line runs from tau(4) = 45/49 to tau(16) = 35/17: b = (950/833)/12 = 475/4998 s.
    noisy = [on_curve(0.5, 0.1, 4, 0.02), on_curve(0.5, 0.1, 16, 0.02)]
    assert per_sample_floor(noisy) == pytest.approx(475 / 4998, rel=EXACT)
    assert ceiling(noisy) == pytest.approx(4998 / 475, rel=EXACT)
    one = [Reading(mbs=8, throughput=100.0, half_width=0.02)]  # all of its time may be fixed work
    assert per_sample_floor(one) == 0.0
    assert ceiling(one) is None


@pytest.mark.parametrize("mbs, throughput, half_width", [(0, 1.0, 0.0), (1, 0.0, 0.0), (1, float("inf"), 0.0),
                                                         (1, 1.0, -0.01), (1, 1.0, float("nan"))])
def test_a_reading_out_of_range_raises(mbs, throughput, half_width):
    with pytest.raises(ValueError):
        Reading(mbs=mbs, throughput=throughput, half_width=half_width)


def test_bounds_at_mbs_under_one_raises():
    with pytest.raises(ValueError):
        bounds([Reading(mbs=8, throughput=100.0, half_width=0.0)], 0)
