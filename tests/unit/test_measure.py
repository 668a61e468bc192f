"""Tests for zerotune.core.measure: the metric from the step probe's streams, exactly."""
import math
import statistics

import pytest

from zerotune.core import measure as core
from zerotune.core.objective import OBJECTIVES
from zerotune.probe import step_records

T_975_3 = 3.182446305284263  # Student t, 97.5% quantile, 3 degrees of freedom


# The streams below are written as the probe's lines (JSON objects); zerotune reads them as validated records.
def measure(lines, objective):
    return core.measure(step_records(lines), objective)


def peak_bytes(lines):
    return core.peak_bytes(step_records(lines))


def step_stats(lines):
    return core.step_stats(step_records(lines))


def stream(rank: int, step_s: list, train_batch_size: int = 16, peak: int = 2**30) -> list[dict]:
    t, lines = 100.0, []
    for i, s in enumerate(step_s, start=1):
        t += s or 0.0
        lines.append({"rank": rank, "step": i, "t": t, "step_s": s, "micro_steps": 2,
                      "train_batch_size": train_batch_size, "peak_bytes": peak + i})
    return lines


# Slowest per step: 1.0 (r0), 0.5 (r0), 0.22 (r1), 0.21 (r0), 0.20 (r0), 0.22 (r0). Step 1 is
# always warm-up; step 2 is too (0.5 > 1.5 x median(0.22, 0.21, 0.20, 0.22) = 0.3225); step 3 is
# not (0.22 <= 1.5 x 0.21).
TWO_RANKS = {0: stream(0, [1.0, 0.5, 0.20, 0.21, 0.20, 0.22], peak=3 * 2**30),
             1: stream(1, [0.9, 0.45, 0.22, 0.20, 0.19, 0.21])}
STEADY = [0.22, 0.21, 0.20, 0.22]


def test_steady_state_is_the_slowest_rank_after_a_detected_warm_up():
    stats = step_stats(TWO_RANKS)
    assert stats.steps == (1, 2, 3, 4, 5, 6)
    assert stats.step_s == (1.0, 0.5, 0.22, 0.21, 0.20, 0.22)
    assert stats.slowest_rank == (0, 0, 1, 0, 0, 0)
    assert stats.warmup_steps == 2 and stats.steady_s == tuple(STEADY)


def test_throughput_is_train_batch_size_over_the_mean_slowest_step_with_a_t_interval():
    m = measure(TWO_RANKS, OBJECTIVES["throughput"])
    mean = sum(STEADY) / 4
    assert m.mean_step_s == pytest.approx(0.2125, abs=1e-12)
    assert m.value == 16 / m.mean_step_s
    assert m.value == pytest.approx(75.29411764705883, abs=1e-9)
    half_width = T_975_3 * statistics.stdev(STEADY) / math.sqrt(4)
    assert m.rel_half_width == pytest.approx(half_width / mean, abs=1e-9)
    assert m.rel_half_width == pytest.approx(0.07169318498, abs=1e-9)
    assert (m.steady_steps, m.warmup_steps, m.train_batch_size) == (4, 2, 16)
    assert m.slowest_rank_share == {0: 0.75, 1: 0.25}
    assert m.peak_bytes == {0: 3 * 2**30 + 6, 1: 2**30 + 6}


def test_the_once_per_step_share_is_the_ranks_largest_boundary_time_over_the_mean_step():
    streams = {rank: [dict(line, boundary_s=b) for line, b in zip(TWO_RANKS[rank], bs)]
               for rank, bs in ((0, [0.5, 0.1, 0.010, 0.012, 0.011, 0.010]), (1, [0.4, 0.1, 0.014, 0.010, 0.009, 0.012]))}
    m = measure(streams, OBJECTIVES["throughput"])
    # steady steps 3-6: the larger of the two ranks' boundary_s, 0.014, 0.012, 0.011, 0.012 (mean 0.01225),
    # over the mean slowest step_s 0.2125
    assert m.boundary_share == pytest.approx(0.01225 / 0.2125, abs=1e-12)
    assert measure(TWO_RANKS, OBJECTIVES["throughput"]).boundary_share is None  # a probe without boundary_s
    streams[1][4].pop("boundary_s")  # one steady step of one rank lacks it: no share
    assert measure(streams, OBJECTIVES["throughput"]).boundary_share is None


def test_tokens_per_second_sums_the_ranks_tokens_over_the_steady_steps_per_mean_step():
    # Ulysses with sequence_parallel_size 2 on 2 ranks: one replica of 16 samples x 512 tokens a step, each rank
    # holding half of each sample's tokens; rank 1's step 3 held a shorter batch
    tokens = {0: [4096] * 6, 1: [4096, 4096, 3072, 4096, 4096, 4096]}
    streams = {rank: [dict(line, tokens=n) for line, n in zip(TWO_RANKS[rank], tokens[rank])] for rank in (0, 1)}
    m = measure(streams, OBJECTIVES["throughput"])
    # steady steps 3-6 sum 7168, 8192, 8192, 8192 tokens (mean 7936) over the mean slowest step 0.2125 s
    assert m.tokens_per_s == pytest.approx(7936 / 0.2125, abs=1e-9)
    assert measure(TWO_RANKS, OBJECTIVES["throughput"]).tokens_per_s is None  # no token ids in the batch
    streams[0][2]["tokens"] = None  # a steady step of one rank without it: unknown
    assert measure(streams, OBJECTIVES["throughput"]).tokens_per_s is None
    streams[0][2]["tokens"] = 0  # not a count of tokens (>= 1): the same
    assert measure(streams, OBJECTIVES["throughput"]).tokens_per_s is None


def test_an_autotp_group_counts_its_batch_once_in_samples_and_tokens():
    # AutoTP 2 on 2 ranks at ZeRO 1: DeepSpeed's train_batch_size 16 counts both ranks, which hold the same 8
    # samples of 512 tokens (DeepSpeed checks their inputs are equal): 8 samples and 4,096 tokens a step
    streams = {rank: [dict(line, autotp_size=2, tokens=4096) for line in TWO_RANKS[rank]] for rank in (0, 1)}
    m = measure(streams, OBJECTIVES["throughput"])
    assert m.value == 8 / m.mean_step_s and m.train_batch_size == 8
    assert m.tokens_per_s == pytest.approx(4096 / 0.2125, abs=1e-9)


def test_latency_is_the_mean_slowest_step_in_seconds():
    m = measure(TWO_RANKS, OBJECTIVES["latency"])
    assert m.value == m.mean_step_s == pytest.approx(0.2125, abs=1e-12)
    assert m.rel_half_width == measure(TWO_RANKS, OBJECTIVES["throughput"]).rel_half_width


def test_one_steady_step_has_a_value_but_no_interval():
    m = measure({0: stream(0, [2.0, 0.25]), 1: stream(1, [2.0, 0.5])}, OBJECTIVES["throughput"])
    assert (m.value, m.rel_half_width, m.steady_steps, m.warmup_steps) == (32.0, None, 1, 1)


def test_only_steps_present_on_every_rank_count():
    # rank 1 was killed before it wrote step 5; step 1 has no step_s on rank 0 (no forward seen).
    streams = {0: stream(0, [None, 0.3, 0.3, 0.3, 0.3]), 1: stream(1, [0.9, 0.3, 0.3, 0.5])}
    stats = step_stats(streams)
    assert stats.steps == (2, 3, 4) and stats.warmup_steps == 0  # step 1 is not among them
    assert measure(streams, OBJECTIVES["latency"]).value == pytest.approx((0.3 + 0.3 + 0.5) / 3, abs=1e-12)


def test_a_slow_step_after_the_warm_up_stays_in_the_steady_state():
    stats = step_stats({0: stream(0, [5.0, 0.2, 0.2, 0.9, 0.2, 0.2])})
    assert stats.warmup_steps == 1 and stats.steady_s == (0.2, 0.2, 0.9, 0.2, 0.2)


def test_no_measurement_falls_back_to_deepspeed():
    assert measure({}, OBJECTIVES["throughput"]) is None  # no stream (SIMULATED backend, profile run)
    assert measure({0: stream(0, [1.0]), 1: stream(1, [1.0])}, OBJECTIVES["throughput"]) is None  # warm-up only
    assert measure(TWO_RANKS, OBJECTIVES["flops"]) is None  # the probe counts no FLOPs
    assert measure({0: [{"rank": 0, "step": 1, "garbage": True}]}, OBJECTIVES["latency"]) is None


def test_peak_bytes_is_each_ranks_largest():
    assert peak_bytes(TWO_RANKS) == {0: 3 * 2**30 + 6, 1: 2**30 + 6}
    assert peak_bytes({0: [{"step": 1}]}) == {}


def test_on_cuda_the_peak_is_the_devices_not_the_allocated_bytes():
    # what the budget limits: the reserved high-water mark plus the context, 13 GB, not the 7 GB allocated
    cuda = [{"step": 1, "peak_bytes": 6 * 10**9, "device_peak_bytes": 12 * 10**9},
            {"step": 2, "peak_bytes": 7 * 10**9, "peak_reserved_bytes": 9 * 10**9, "device_peak_bytes": 13 * 10**9}]
    assert peak_bytes({0: cuda, 1: [{"step": 1, "peak_bytes": 5 * 10**9}]}) == {0: 13 * 10**9, 1: 5 * 10**9}


def test_the_longest_sequence_is_per_step_the_ranks_longest_and_the_runs_longest_over_every_step():
    lines = {0: [{"step": 1, "seq_len": 512}, {"step": 2, "seq_len": 96}, {"step": 3}],
             1: [{"step": 1, "seq_len": 128}, {"step": 2, "seq_len": 200}, {"step": 4, "seq_len": 64},
                 {"seq_len": 4096}]}  # a line without a step says no step
    assert core.seq_lens(step_records(lines)) == {1: 512, 2: 200, 4: 64}
    assert core.max_seq_len(step_records(lines)) == 512  # the warm-up step too: what the run's batches held
    assert core.max_seq_len(step_records(TWO_RANKS)) is None  # no record gives one (images, an older probe)
    assert core.max_seq_len({}) is None


def test_the_longest_seen_is_from_step_2_on_where_a_later_step_gives_one_and_the_shortest_over_every_step():
    # step 1 held 512 tokens without the optimizer states; steps 2-3 at most 200: the run's peak pairs with 200
    lines = {0: [{"step": 1, "seq_len": 512}, {"step": 2, "seq_len": 96}, {"step": 3, "seq_len": 150}],
             1: [{"step": 1, "seq_len": 128}, {"step": 2, "seq_len": 200}, {"step": 3, "seq_len": 64}]}
    assert core.seen_seq_lens(step_records(lines)) == (200, 150)  # steps' longest: 512, 200, 150
    lines[1][0]["seq_len"] = 100  # a shorter step 1 counts in the shortest
    lines[0][0]["seq_len"] = 32
    assert core.seen_seq_lens(step_records(lines)) == (200, 100)
    # no step 2 (a run that ended in step 2), or no length after step 1: step 1's own
    assert core.seen_seq_lens(step_records({0: [{"step": 1, "seq_len": 512}]})) == (512, 512)
    assert core.seen_seq_lens(step_records({0: [{"step": 1, "seq_len": 512}, {"step": 2}]})) == (512, 512)
    assert core.seen_seq_lens(step_records(TWO_RANKS)) == (None, None)
    assert core.seen_seq_lens({}) == (None, None)


def test_a_slowly_decaying_warm_up_is_cut_by_the_marginal_standard_error_rule():
    # a real run here (z0 mbs 32 on 2 CPU ranks, both ranks alike): steps 2-4 still warming up
    steps = [2.269, 1.679, 1.365, 1.296, 1.191, 1.141, 1.196, 1.17, 1.168, 1.184, 1.201]
    stats = step_stats({0: stream(0, steps)})
    # the 1.5x rule alone keeps 1.679 (< 1.5 x the median 1.19); MSER cuts 5 more (at most half of the 10)
    assert stats.warmup_steps == 6 and stats.steady_s == (1.196, 1.17, 1.168, 1.184, 1.201)
