"""A least-squares line with lower bounds: the arithmetic of the memory model's online fit (D110).

Fits ``y = intercept + slope * x`` to weighted points, minimising ``sum w * (intercept + slope * x - y)**2``
subject to lower bounds ``intercept + slope * x >= y_min`` (an out-of-memory run: its peak was above the budget)
and ``slope >= 0`` (memory never shrinks as the micro batch grows). A tiny penalty ``TIE_BREAK * (slope -
tie_slope)**2`` makes the minimum unique where the points cannot fix the slope (every point at one ``x``, or only
bounds): the slope nearest ``tie_slope`` wins; elsewhere it moves the slope by well under a byte per sample.
Solved exactly (`fit_line`); pure arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

TIE_BREAK = 1e-6
"""Weight of ``(slope - tie_slope)**2`` in the objective, per sample squared."""
_TOLERANCE = 1e-9
"""Relative slack on every bound a candidate does not hold as an equality (plus a thousandth of a unit), for the
rounding of a solution computed from the others."""

_Constraint = tuple[float, float, float]  # (p, q, r): p * intercept + q * slope >= r


@dataclass(frozen=True)
class Line:
    """``intercept + slope * x``."""

    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(points: Sequence[tuple[float, float, float]], bounds: Sequence[tuple[float, float]] = (),
             tie_slope: float = 0.0) -> Line:
    """The least-squares line through ``points`` that stays on or above every bound and has ``slope >= 0``.

    Exact: a convex quadratic program in two variables is minimal where some set of its constraints holds as
    equalities (the active set, Karush-Kuhn-Tucker); every set of at most two is solved and the best feasible kept.

    Args:
        points: ``(x, y, weight)``, weights above 0; at least one.
        bounds: ``(x, y_min)``: the line at ``x`` is at least ``y_min``.
        tie_slope: the slope preferred among equally good lines (the module's tie-break).

    Raises:
        ValueError: no point, or a weight not above 0.
    """
    if not points or any(not w > 0 for _, _, w in points):
        raise ValueError("fit_line needs at least one point, each with a weight above 0")
    constraints: list[_Constraint] = [(0.0, 1.0, 0.0)] + [(1.0, float(x), float(y)) for x, y in bounds]
    best: tuple[float, Line] | None = None
    for k in range(3):
        for active in combinations(constraints, k):
            line = _solve(points, active, tie_slope)
            if line is None or not all(_holds(line, c) for c in constraints if c not in active):
                continue
            cost = _cost(points, line, tie_slope)
            if best is None or cost < best[0]:
                best = (cost, line)
    assert best is not None  # the slope bound alone and the points always give a feasible minimum
    return best[1]


def _holds(line: Line, c: _Constraint) -> bool:
    p, q, r = c
    value = p * line.intercept + q * line.slope
    return value >= r - _TOLERANCE * max(abs(r), abs(p * line.intercept) + abs(q * line.slope)) - 1e-3


def _cost(points: Sequence[tuple[float, float, float]], line: Line, tie_slope: float) -> float:
    return sum(w * (line.at(x) - y) ** 2 for x, y, w in points) + TIE_BREAK * (line.slope - tie_slope) ** 2


def _solve(points: Sequence[tuple[float, float, float]], active: Sequence[_Constraint],
           tie_slope: float) -> Line | None:
    """The minimum with the ``active`` constraints held as equalities (the Lagrange system, 2 + k unknowns);
    None where that system is singular (two parallel constraints)."""
    sw = sum(w for _, _, w in points)
    sx = sum(w * x for x, _, w in points)
    sxx = sum(w * x * x for x, _, w in points) + TIE_BREAK
    sy = sum(w * y for _, y, w in points)
    sxy = sum(w * x * y for x, y, w in points) + TIE_BREAK * tie_slope
    n = 2 + len(active)
    matrix = [[0.0] * n for _ in range(n)]
    matrix[0][:2], matrix[1][:2] = [sw, sx], [sx, sxx]
    rhs = [sy, sxy] + [r for _, _, r in active]
    for i, (p, q, _) in enumerate(active):
        matrix[0][2 + i] = matrix[2 + i][0] = p
        matrix[1][2 + i] = matrix[2 + i][1] = q
    solution = _gauss(matrix, rhs)
    return None if solution is None else Line(solution[0], solution[1])


def _gauss(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """``matrix @ x = rhs`` by Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    a = [row[:] + [b] for row, b in zip(matrix, rhs)]
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * u for v, u in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]
