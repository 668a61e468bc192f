"""Tests for zerotune.run.resources (hostfiles, include/exclude, num_nodes/num_gpus) and zerotune.run.slots
(the slot pool)."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.launch import Node, Reservation
from zerotune.run.resources import parse_hostfile, select_resources
from zerotune.run.slots import SlotPool


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


# --- parse_hostfile ---------------------------------------------------------------------------


def test_hostfile_comments_blank_lines_and_order(tmp_path):
    path = write(
        tmp_path,
        "# cluster\n"
        "\n"
        "worker-1 slots=4   # the small one\n"
        "   worker-0\tslots=8\n"
        "worker-2 slots=2#no space before the comment\n"
        "worker-3 slots=1 max_slots=1\n",  # MPI-style extra token: the launcher accepts it too
    )
    hosts = parse_hostfile(path)
    assert hosts == {"worker-1": 4, "worker-0": 8, "worker-2": 2, "worker-3": 1}
    assert list(hosts) == ["worker-1", "worker-0", "worker-2", "worker-3"]
    assert parse_hostfile(str(path)) == hosts


@pytest.mark.parametrize(
    "text, lineno, line, expected",
    [
        ("worker-0 slots=8\nworker-1 slots\n", 2, "worker-1 slots", "expected 'HOSTNAME slots=N'"),
        ("worker-0\n", 1, "worker-0", "expected 'HOSTNAME slots=N'"),
        ("worker-0 slots=8x\n", 1, "worker-0 slots=8x", "expected 'HOSTNAME slots=N'"),
        ("worker-0 gpus=8\n", 1, "worker-0 gpus=8", "expected 'HOSTNAME slots=N'"),
        ("# c\nworker-0 slots=0\n", 2, "worker-0 slots=0", "slots must be a positive integer of at most 1048576, got 0"),
        ("worker-0 slots=-2\n", 1, "worker-0 slots=-2", "slots must be a positive integer of at most 1048576, got -2"),
        ("worker-0 slots=99999999999999999999\n", 1, "worker-0 slots=99999999999999999999",
         "slots must be a positive integer of at most 1048576, got 99999999999999999999"),  # not an OverflowError
        (
            "worker-0 slots=8\n\nworker-1 slots=8\nworker-0 slots=4 # again\n",
            4,
            "worker-0 slots=4 # again",
            "host 'worker-0' is listed twice (first on line 1)",
        ),
    ],
)
def test_hostfile_bad_lines_name_file_line_and_text(tmp_path, text, lineno, line, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        parse_hostfile(path)
    message = str(err.value)
    assert f"hostfile {path} line {lineno} ({line!r})" in message
    assert expected in message


def test_hostfile_missing_names_path(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"hostfile {path} does not exist"):
        parse_hostfile(path)


def test_hostfile_without_hosts(tmp_path):
    path = write(tmp_path, "# only a comment\n\n")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile(path)


# --- select_resources -------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path):
    """worker-0: 8 slots, worker-1: 4 slots, worker-2: 2 slots."""
    return write(tmp_path, "worker-0 slots=8\nworker-1 slots=4\nworker-2 slots=2\n")


def test_select_all_of_hostfile_keeps_different_slot_counts(cluster):
    assert select_resources(cluster) == [
        Node("worker-0", tuple(range(8))),
        Node("worker-1", (0, 1, 2, 3)),
        Node("worker-2", (0, 1)),
    ]


def test_include_keeps_real_device_ids_and_hostfile_order(cluster):
    nodes = select_resources(cluster, include="worker-2@worker-0:5,4")
    assert nodes == [Node("worker-0", (4, 5)), Node("worker-2", (0, 1))]


def test_include_merges_repeated_host_like_deepspeed(cluster):
    assert select_resources(cluster, include="worker-1:3@worker-1:1,3") == [Node("worker-1", (1, 3))]
    # As in the launcher, a bare mention merged with a slot list leaves just the slots.
    assert select_resources(cluster, include="worker-1@worker-1:2") == [Node("worker-1", (2,))]


def test_exclude_slots_and_whole_hosts(cluster):
    nodes = select_resources(cluster, exclude="worker-0:0,7@worker-2")
    assert nodes == [Node("worker-0", (1, 2, 3, 4, 5, 6)), Node("worker-1", (0, 1, 2, 3))]


def test_exclude_every_slot_of_a_host_drops_it(cluster):
    nodes = select_resources(cluster, exclude="worker-2:0,1")
    assert [n.host for n in nodes] == ["worker-0", "worker-1"]


def test_exclude_everything(cluster):
    with pytest.raises(ConfigError, match="leaves no device slots"):
        select_resources(cluster, exclude="worker-0@worker-1@worker-2")


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"include": "worker-9"}, "--include 'worker-9': host 'worker-9' is not among the hosts (worker-0, worker-1, worker-2)"),
        ({"exclude": "worker-0@worker-7:1"}, "host 'worker-7' is not among the hosts"),
        ({"include": "worker-2:0,2"}, "--include 'worker-2:0,2': host 'worker-2' has no slot 2 (its slots: 0,1)"),
        ({"exclude": "worker-1:4"}, "host 'worker-1' has no slot 4 (its slots: 0,1,2,3)"),
        ({"include": "worker-0:a"}, "slot 'a' on host 'worker-0' is not a device id"),
        ({"include": "worker-0:"}, "slot '' on host 'worker-0' is not a device id"),
        ({"include": "worker-0:1:2"}, "bad node spec 'worker-0:1:2'"),
        ({"include": "worker-0@"}, "bad node spec ''"),
        ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
        ({"include": "worker-0", "num_gpus": 2}, "--num_gpus cannot be combined with --include 'worker-0'"),
        ({"exclude": "worker-0", "num_nodes": 1}, "--num_nodes cannot be combined with --exclude 'worker-0'"),
        ({"num_nodes": 0}, "--num_nodes must be a positive integer (or -1 for all), got 0"),
        ({"num_gpus": -3}, "--num_gpus must be a positive integer (or -1 for all), got -3"),
        ({"num_nodes": 4}, "--num_nodes 4 but hostfile"),
        ({"num_gpus": 3}, "--num_gpus 3 but host 'worker-2' has 2 slot(s)"),
    ],
)
def test_select_errors_name_the_culprit(cluster, kwargs, expected):
    with pytest.raises(ConfigError) as err:
        select_resources(cluster, **kwargs)
    assert expected in str(err.value)


def test_num_nodes_keeps_first_hosts(cluster):
    nodes = select_resources(cluster, num_nodes=2)
    assert nodes == [Node("worker-0", tuple(range(8))), Node("worker-1", (0, 1, 2, 3))]


def test_num_gpus_keeps_first_slots_per_host(cluster):
    nodes = select_resources(cluster, num_gpus=2)
    assert nodes == [Node("worker-0", (0, 1)), Node("worker-1", (0, 1)), Node("worker-2", (0, 1))]


def test_num_nodes_and_num_gpus_together(cluster):
    assert select_resources(cluster, num_nodes=1, num_gpus=3) == [Node("worker-0", (0, 1, 2))]


def test_localhost_from_local_slots():
    assert select_resources(local_slots=4) == [Node("localhost", (0, 1, 2, 3))]
    assert select_resources(local_slots=4, num_gpus=2) == [Node("localhost", (0, 1))]
    assert select_resources(local_slots=4, num_nodes=1) == [Node("localhost", (0, 1, 2, 3))]


def test_include_exclude_apply_to_localhost():
    assert select_resources(local_slots=4, include="localhost:1,3") == [Node("localhost", (1, 3))]
    assert select_resources(local_slots=4, exclude="localhost:0") == [Node("localhost", (1, 2, 3))]
    with pytest.raises(ConfigError, match="host 'worker-0' is not among the hosts \\(localhost\\)"):
        select_resources(local_slots=4, include="worker-0")


def test_localhost_errors():
    with pytest.raises(ConfigError, match="--num_nodes 2 but no hostfile .* give a --hostfile"):
        select_resources(local_slots=4, num_nodes=2)
    with pytest.raises(ConfigError, match="must be positive, got 0"):
        select_resources(local_slots=0)


def test_no_cuda_needs_num_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device found .* pass --num_gpus N"):
        select_resources()


def test_detected_cuda_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_resources() == [Node("localhost", (0, 1))]


def test_cuda_visible_devices_are_the_real_ids(monkeypatch):
    # The launcher sets CUDA_VISIBLE_DEVICES itself from --include, so ids must be the physical ones.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert select_resources() == [Node("localhost", (2, 3))]
    assert select_resources(num_gpus=1) == [Node("localhost", (2,))]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='GPU-8f2a' is not a list of device ids"):
        select_resources()


# --- Node / Reservation -----------------------------------------------------------------------


def test_node_validates_slots():
    with pytest.raises(ValueError):
        Node("w", (1, 0))
    with pytest.raises(ValueError):
        Node("w", (0, 0))
    with pytest.raises(ValueError):
        Node("", (0,))
    assert Node("w", (2, 5)).num_slots == 2


def test_reservation_include_arg_and_world_size():
    one = Reservation((Node("localhost", (0, 1)),))
    assert one.include_arg() == "localhost:0,1"
    assert one.world_size == 2
    two = Reservation((Node("worker-0", (0, 1)), Node("worker-1", (2, 3))))
    assert two.include_arg() == "worker-0:0,1@worker-1:2,3"
    assert two.world_size == 4
    assert two.num_nodes == 2


# --- SlotPool ---------------------------------------------------------------------------------


def test_two_halves_fit_and_a_third_waits():
    pool = SlotPool([Node("localhost", (0, 1, 2, 3))])
    first = pool.try_reserve(1, 2)
    second = pool.try_reserve(1, 2)
    assert first.include_arg() == "localhost:0,1"
    assert second.include_arg() == "localhost:2,3"
    assert pool.try_reserve(1, 2) is None
    assert pool.free_slots == 0
    pool.release(first)
    third = pool.try_reserve(1, 2)
    assert third.include_arg() == "localhost:0,1"
    assert pool.free_slots == 0


def test_first_fit_lowest_ids_on_real_device_ids():
    pool = SlotPool([Node("worker-0", (4, 5, 6)), Node("worker-1", (0, 1, 2, 3))])
    a = pool.try_reserve(1, 2)
    assert a.nodes == (Node("worker-0", (4, 5)),)
    b = pool.try_reserve(1, 2)  # worker-0 has 1 free slot left: skip to worker-1
    assert b.nodes == (Node("worker-1", (0, 1)),)
    c = pool.try_reserve(1, 1)
    assert c.nodes == (Node("worker-0", (6,)),)
    pool.release(a)
    d = pool.try_reserve(2, 2)
    assert d.include_arg() == "worker-0:4,5@worker-1:2,3"
    assert d.world_size == 4
    assert pool.free_slots == 0


def test_multi_node_request_is_all_or_nothing():
    pool = SlotPool([Node("worker-0", (0, 1)), Node("worker-1", (0, 1))])
    held = pool.try_reserve(1, 1)  # worker-0:0
    assert pool.try_reserve(2, 2) is None  # worker-0 has only one free slot
    assert pool.free_slots == 3  # nothing taken by the failed attempt
    pool.release(held)
    assert pool.try_reserve(2, 2).include_arg() == "worker-0:0,1@worker-1:0,1"


def test_release_twice_or_foreign_is_an_error():
    pool = SlotPool([Node("localhost", (0, 1))])
    r = pool.try_reserve(1, 2)
    pool.release(r)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(r)
    # An equal-looking reservation that this pool never handed out does not free the slots.
    r2 = pool.try_reserve(1, 2)
    with pytest.raises(ValueError):
        pool.release(Reservation(r2.nodes))
    with pytest.raises(ValueError):
        pool.release(r)
    assert pool.free_slots == 0
    pool.release(r2)
    assert pool.free_slots == 2


def test_bad_requests():
    pool = SlotPool([Node("localhost", (0,))])
    with pytest.raises(ValueError):
        pool.try_reserve(0, 1)
    with pytest.raises(ValueError):
        pool.capacity(1, 0)
    with pytest.raises(ValueError, match="unique hosts"):
        SlotPool([Node("a", (0,)), Node("a", (1,))])


def test_capacity_and_can_ever_fit():
    pool = SlotPool([Node("worker-0", tuple(range(8))), Node("worker-1", tuple(range(8)))])
    assert pool.total_slots == 16
    assert pool.capacity(1, 4) == 4
    assert pool.capacity(2, 4) == 2
    assert pool.capacity(1, 3) == 4  # 2 per node, 2 slots left idle on each
    assert pool.capacity(2, 8) == 1
    assert pool.capacity(1, 9) == 0
    assert pool.capacity(3, 1) == 0
    assert pool.can_ever_fit(2, 8)
    assert not pool.can_ever_fit(3, 1)
    assert not pool.can_ever_fit(1, 9)

    mixed = SlotPool([Node("worker-0", tuple(range(8))), Node("worker-1", (0, 1, 2, 3))])
    assert mixed.capacity(1, 4) == 3
    assert mixed.capacity(2, 4) == 1
    assert mixed.can_ever_fit(1, 8) and not mixed.can_ever_fit(2, 8)
    # capacity never changes the pool
    assert mixed.free_slots == 12


def test_capacity_matches_what_try_reserve_achieves():
    nodes = [Node("a", (0, 1, 2)), Node("b", (0, 1, 2, 3, 4)), Node("c", (7,))]
    for num_nodes in (1, 2, 3):
        for per_node in (1, 2, 3):
            pool = SlotPool(nodes)
            got = 0
            while pool.try_reserve(num_nodes, per_node) is not None:
                got += 1
            assert got == SlotPool(nodes).capacity(num_nodes, per_node), (num_nodes, per_node)


def test_concurrent_reserve_release_never_double_books():
    nodes = [Node("worker-0", tuple(range(8))), Node("worker-1", (0, 1, 2, 3, 4, 5))]
    pool = SlotPool(nodes)
    owners: dict[tuple[str, int], int] = {}
    owners_lock = threading.Lock()
    errors: list[str] = []
    successes = [0] * 16
    start = threading.Barrier(16)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        start.wait()
        for _ in range(300):
            r = pool.try_reserve(rng.choice([1, 2]), rng.choice([1, 2, 3]))
            if r is None:
                continue
            successes[tid] += 1
            keys = [(n.host, s) for n in r.nodes for s in n.slots]
            with owners_lock:
                for key in keys:
                    if key in owners:
                        errors.append(f"{key} held by {owners[key]} and {tid}")
                    owners[key] = tid
            time.sleep(0.0001)  # hold the slots a moment so an overlapping booking is seen
            with owners_lock:
                for key in keys:
                    del owners[key]
            pool.release(r)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(successes) > 100, successes
    assert pool.free_slots == pool.total_slots == 14
    # everything is free again: the whole pool can be reserved in one go
    assert pool.try_reserve(2, 6).include_arg() == "worker-0:0,1,2,3,4,5@worker-1:0,1,2,3,4,5"
