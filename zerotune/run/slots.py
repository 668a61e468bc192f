"""Who holds the device slots: the ``SlotPool`` that hands a ``Reservation`` (`zerotune.core.launch`) to each
experiment. Which slots exist, and what a slot is, is `zerotune.run.resources`'.
"""
from __future__ import annotations

import threading

from zerotune.core.launch import Node, Reservation

__all__ = ["LOCALHOST", "SlotPool"]

LOCALHOST = "localhost"


class SlotPool:
    """Thread-safe record of which device slots are free and which experiment holds the others.

    An experiment asks for ``num_nodes`` x ``slots_per_node`` (DeepSpeed runs as many ranks on every node of a run).
    Placement is deterministic first fit: nodes in order, the lowest free slot ids on each.

    Raises:
        ValueError: ``nodes`` (from ``select_resources``) repeat a host.
    """

    def __init__(self, nodes: list[Node]) -> None:
        hosts = [n.host for n in nodes]
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"SlotPool nodes must have unique hosts, got {hosts}")
        self._nodes = tuple(nodes)
        self._free: dict[str, set[int]] = {n.host: set(n.slots) for n in nodes}
        self._held: dict[int, Reservation] = {}  # id(reservation) -> reservation (kept alive)
        self._lock = threading.Lock()

    @property
    def nodes(self) -> tuple[Node, ...]:
        """All nodes of the pool with all their slots, free or not."""
        return self._nodes

    @property
    def total_slots(self) -> int:
        """Number of device slots in the pool, free or held."""
        return sum(len(n.slots) for n in self._nodes)

    @property
    def free_slots(self) -> int:
        """Number of device slots not held by any reservation right now."""
        with self._lock:
            return sum(len(s) for s in self._free.values())

    def try_reserve(self, num_nodes: int, slots_per_node: int) -> Reservation | None:
        """Reserve ``slots_per_node`` free slots on each of ``num_nodes`` distinct nodes, all or nothing (first fit).

        Returns:
            The reservation, to be given back with ``release``; ``None`` when the slots are not free now (always,
            when ``can_ever_fit`` is False).

        Raises:
            ValueError: ``num_nodes`` or ``slots_per_node`` below 1.
        """
        _check_request(num_nodes, slots_per_node)
        with self._lock:
            picked = _first_fit(self._nodes, self._free, num_nodes, slots_per_node)
            if picked is None:
                return None
            for node in picked:
                self._free[node.host].difference_update(node.slots)
            reservation = Reservation(tuple(picked))
            self._held[id(reservation)] = reservation
            return reservation

    def release(self, reservation: Reservation) -> None:
        """Give back the slots of a reservation made by this pool.

        Raises:
            ValueError: the reservation was already released or is not from this pool.
        """
        with self._lock:
            if self._held.get(id(reservation)) is not reservation:
                raise ValueError(
                    f"reservation {reservation.include_arg()} is not held in this pool "
                    "(released twice, or made by another pool)"
                )
            del self._held[id(reservation)]
            for node in reservation.nodes:
                self._free[node.host].update(node.slots)

    def capacity(self, num_nodes: int, slots_per_node: int) -> int:
        """How many such requests run at once on an empty pool, placed first fit (2 nodes of 8 slots:
        ``capacity(1, 3) == 4``, 2 per node)."""

        _check_request(num_nodes, slots_per_node)
        free = {n.host: set(n.slots) for n in self._nodes}
        count = 0
        while (picked := _first_fit(self._nodes, free, num_nodes, slots_per_node)) is not None:
            for node in picked:
                free[node.host].difference_update(node.slots)
            count += 1
        return count

    def can_ever_fit(self, num_nodes: int, slots_per_node: int) -> bool:
        """True when the request fits the empty pool (``num_nodes`` nodes with enough slots each)."""
        _check_request(num_nodes, slots_per_node)
        return sum(1 for n in self._nodes if len(n.slots) >= slots_per_node) >= num_nodes


def _check_request(num_nodes: int, slots_per_node: int) -> None:
    if num_nodes < 1 or slots_per_node < 1:
        raise ValueError(
            f"a slot request needs num_nodes >= 1 and slots_per_node >= 1, "
            f"got {num_nodes} x {slots_per_node}"
        )


def _first_fit(
    nodes: tuple[Node, ...], free: dict[str, set[int]], num_nodes: int, slots_per_node: int
) -> list[Node] | None:
    """The first ``num_nodes`` nodes with ``slots_per_node`` free slots, lowest ids; None if short."""
    picked: list[Node] = []
    for node in nodes:
        if len(free[node.host]) >= slots_per_node:
            picked.append(Node(node.host, tuple(sorted(free[node.host])[:slots_per_node])))
            if len(picked) == num_nodes:
                return picked
    return None
