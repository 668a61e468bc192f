"""The throughput model: what an mbs that has not run can reach, bounded by the ones that have (D107).

Rules: within a config family (one ZeRO stage, gas and set of knobs; only mbs differs) a step's time is affine in mbs,
``tau(m) = m / throughput(m) = a + b * m`` with ``a, b >= 0`` (DP world size x gas folded in). Each `Reading` bounds
``tau`` at its mbs by its 95% half-width; `bounds` gives the slowest and fastest samples/s at another mbs over every
such curve, `ceiling` the fastest any mbs could reach. Where no curve fits the readings (samples/s falling with mbs
beyond the noise: allocator slowdowns near the memory limit, CPU caches) they give None: the model does not apply and
the caller must run the mbs. The bounds are exact (`_vertices`). Pure arithmetic; no imports from the strategy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

MAX_HALF_WIDTH = 0.5
"""A half-width above this is clamped to it: ``1 - h`` must stay well above 0."""
_TOLERANCE = 1e-9
"""Relative slack on every constraint, for the rounding of a vertex computed from two lines."""

_Line = tuple[float, float, float]  # (p, q, r): p * a + q * b = r


@dataclass(frozen=True)
class Reading:
    """One measured point of a config family's throughput curve. Raises ValueError on an mbs under 1, a throughput
    that is not finite and positive, or a negative (or NaN) half-width."""

    mbs: int
    """Micro batch size per GPU of the run."""
    throughput: float
    """Its measured throughput, samples/s (> 0)."""
    half_width: float
    """Relative 95% half-width of ``throughput`` (>= 0; 0.02 is +-2%), run noise and pooling folded in by
    the caller; clamped to `MAX_HALF_WIDTH`."""

    def __post_init__(self) -> None:
        if self.mbs < 1:
            raise ValueError(f"mbs must be at least 1, got {self.mbs}")
        if not (math.isfinite(self.throughput) and self.throughput > 0):
            raise ValueError(f"throughput must be a finite number of samples/s above 0, got {self.throughput}")
        if not self.half_width >= 0:
            raise ValueError(f"half_width must be at least 0, got {self.half_width}")

    def tau_interval(self) -> tuple[float, float]:
        """``(low, high)`` seconds: the values of ``tau(mbs) = mbs / throughput`` within the half-width."""
        h = min(self.half_width, MAX_HALF_WIDTH)
        return self.mbs / (self.throughput * (1 + h)), self.mbs / (self.throughput * (1 - h))


@dataclass(frozen=True)
class Bounds:
    """The throughput an mbs can have on any curve consistent with the readings: ``low <= high``."""

    mbs: int
    """The micro batch size per GPU bounded."""
    low: float
    """The slowest such curve's throughput there, samples/s."""
    high: float
    """The fastest such curve's throughput there, samples/s."""


def _lines(readings: Sequence[Reading]) -> list[_Line]:
    """Every constraint's boundary: ``a = 0``, ``b = 0``, and ``a + b * mbs = tau`` at each end of each
    reading's interval."""
    lines: list[_Line] = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0)]
    for r in readings:
        low, high = r.tau_interval()
        lines += [(1.0, float(r.mbs), low), (1.0, float(r.mbs), high)]
    return lines


def _intersection(u: _Line, v: _Line) -> tuple[float, float] | None:
    det = u[0] * v[1] - u[1] * v[0]
    if det == 0:
        return None
    return (u[2] * v[1] - u[1] * v[2]) / det, (u[0] * v[2] - u[2] * v[0]) / det


def _feasible(point: tuple[float, float], readings: Sequence[Reading]) -> bool:
    """Whether ``(a, b)`` is within every constraint, up to `_TOLERANCE` of each bound's scale."""
    a, b = point
    scale = max(r.tau_interval()[1] for r in readings)
    if a < -_TOLERANCE * scale or b < -_TOLERANCE * scale:
        return False
    for r in readings:
        low, high = r.tau_interval()
        tau = a + b * r.mbs
        if tau < low * (1 - _TOLERANCE) or tau > high * (1 + _TOLERANCE):
            return False
    return True


def _vertices(readings: Sequence[Reading]) -> list[tuple[float, float]]:
    """The feasible polygon's vertices ``(a, b)``, each clamped to ``a, b >= 0``; empty when nothing fits
    (or there are no readings). A linear objective over the polygon is extreme at a vertex, an intersection of two
    constraint lines; the polygon is bounded, as a reading at mbs ``m`` gives ``a <= tau_high`` and
    ``b <= tau_high / m``."""
    if not readings:
        return []
    found = []
    for u, v in combinations(_lines(readings), 2):
        point = _intersection(u, v)
        if point is not None and _feasible(point, readings):
            found.append((max(point[0], 0.0), max(point[1], 0.0)))
    return found


def bounds(readings: Sequence[Reading], mbs: int) -> Bounds | None:
    """The lowest and highest throughput (samples/s) at ``mbs`` over every affine step time ``tau(m) = a + b * m``
    (``a, b >= 0``) within every reading's interval; None when there are no readings or no such curve fits them all.
    ``low`` is never 0: the readings bound ``a`` and ``b``. One reading ``(m, thr, h)`` gives, above ``m``,
    ``high = thr * (1 + h) * mbs / m`` (perfect scaling) and ``low = thr * (1 - h)`` (all time fixed); below ``m``,
    ``high = thr * (1 + h)`` and ``low = thr * (1 - h) * mbs / m``. Raises ValueError for an ``mbs`` under 1."""
    if mbs < 1:
        raise ValueError(f"mbs must be at least 1, got {mbs}")
    taus = [a + b * mbs for a, b in _vertices(readings)]
    if not taus:
        return None
    return Bounds(mbs=mbs, low=mbs / max(taus), high=mbs / min(taus))


def per_sample_floor(readings: Sequence[Reading]) -> float | None:
    """The smallest per-sample time ``b`` (seconds per sample, the slope of ``tau``) consistent with the
    readings; None when there are none or nothing fits. 0 when all the time may be fixed per-step work."""
    slopes = [b for _, b in _vertices(readings)]
    return min(slopes) if slopes else None


def ceiling(readings: Sequence[Reading]) -> float | None:
    """``1 / per_sample_floor(readings)``, samples/s: the compute roofline (Williams et al. 2009), the most any mbs
    could reach with no fixed per-step work, for every config of the readings' model, precision and DP world size
    (stage, gas and knobs may differ). CPU caches can break it (a micro batch that fits a cache runs faster per
    sample). None when the floor is 0 (a flat curve fits) or nothing fits."""
    floor = per_sample_floor(readings)
    return 1.0 / floor if floor else None
