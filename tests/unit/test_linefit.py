"""The least-squares line with lower bounds (zerotune/model/linefit.py), against solutions worked by hand."""
import pytest

from zerotune.model.linefit import Line, fit_line


def close(line: Line, intercept: float, slope: float) -> bool:
    # the tie-break (TIE_BREAK * (slope - tie_slope)**2) moves a solution by about a millionth of the slope
    return line.intercept == pytest.approx(intercept, abs=1e-4) and line.slope == pytest.approx(slope, abs=1e-4)


def test_two_points_give_the_line_through_them_and_more_the_least_squares_one():
    assert close(fit_line([(1, 10, 1), (3, 14, 1)]), 8, 2)
    # (1, 10), (2, 13), (3, 14): slope 2, mean y 37/3 at mean x 2
    assert close(fit_line([(1, 10, 1), (2, 13, 1), (3, 14, 1)]), 37 / 3 - 4, 2)
    # a point counted twice weighs as two
    assert close(fit_line([(1, 10, 2), (3, 14, 1)]), fit_line([(1, 10, 1), (1, 10, 1), (3, 14, 1)]).intercept,
                 fit_line([(1, 10, 1), (1, 10, 1), (3, 14, 1)]).slope)


def test_a_bound_above_the_fit_holds_the_line_on_it():
    # unbounded, the line gives 18 at x = 5; held at 30 there, c = 30 - 5s and (20 - 4s)**2 + (16 - 2s)**2 is least
    # at s = 224 / 40 = 5.6, c = 2
    line = fit_line([(1, 10, 1), (3, 14, 1)], bounds=[(5, 30)])
    assert close(line, 2, 5.6) and line.at(5) == pytest.approx(30)
    assert close(fit_line([(1, 10, 1), (3, 14, 1)], bounds=[(5, 17)]), 8, 2)  # a bound under the fit: no change


def test_the_slope_is_never_below_zero():
    assert close(fit_line([(1, 10, 1), (2, 5, 1)]), 7.5, 0)


def test_a_slope_the_points_cannot_fix_is_the_preferred_one_that_meets_the_bounds():
    assert close(fit_line([(2, 10, 1)], tie_slope=3), 4, 3)
    assert close(fit_line([(2, 10, 1), (2, 12, 1)], tie_slope=3), 5, 3)  # two at one mbs: their mean
    # through (1, 10) the bound at 2 needs a slope of 10, the one at 4 of 20/3: the least slope that meets both
    assert close(fit_line([(1, 10, 1)], bounds=[(2, 20), (4, 30)]), 0, 10)
    assert close(fit_line([(1, 10, 1)], bounds=[(2, 20), (4, 30)], tie_slope=12), -2, 12)


def test_no_point_or_a_weight_not_above_zero_is_an_error():
    with pytest.raises(ValueError):
        fit_line([])
    with pytest.raises(ValueError):
        fit_line([(1, 1, 0)])
