"""How near the device's capacity a run ran: the one test every capacity rule reads.

A run is **calm** when its measured peak is under `NEAR_CAPACITY` of the per-device budget, **near**
when it is at least that, and **unknown** without a measured peak or a budget. CPU ranks have no budget to
read against (their caches, not an allocator's flushes, shape the curve in mbs: a smaller micro-batch can
be faster far from any memory limit), so every run there is unknown. Each rule says what it does with an
unknown run by naming the state it needs (``is Capacity.CALM``, ``is not Capacity.NEAR``).
"""
from __future__ import annotations

import enum

NEAR_CAPACITY = 0.9
"""A run whose measured peak is at least this fraction of the per-device budget runs near the device's
capacity, where a caching allocator flushes and retries and a step can be slower than at a smaller mbs."""


class Capacity(str, enum.Enum):
    """Where a run's measured peak sits against the per-device budget."""

    CALM = "calm"  # under NEAR_CAPACITY of the budget: throughput rises with mbs there
    NEAR = "near"  # at least NEAR_CAPACITY: the allocator's flushes may slow a step
    UNKNOWN = "unknown"  # no measured peak, or no budget (CPU ranks)


def memory_fraction(peak_bytes: int | None, budget_bytes: int | None) -> float | None:
    """A run's measured peak over the per-device budget; None without a peak or a budget (0 counts as none)."""
    if not peak_bytes or not budget_bytes:
        return None
    return peak_bytes / budget_bytes


def capacity(fraction: float | None) -> Capacity:
    """The `Capacity` of a run whose peak is ``fraction`` of the budget (`memory_fraction`)."""
    if fraction is None:
        return Capacity.UNKNOWN
    return Capacity.CALM if fraction < NEAR_CAPACITY else Capacity.NEAR
