"""The gas phase and the answer of zerotune.strategy.tuning.Strategy on known throughput curves (no launch).

A scripted ``evaluate`` gives each experiment the metric of a curve in (ZeRO stage, mbs, gas), known to
±1%, so the whole strategy (profile, stages, mbs search, gas phase) runs in milliseconds and its exact
trace is asserted.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotune.core.experiment import ExperimentKind, Status
from zerotune.core.noise import DEFAULT_PRECISION, RUN_NOISE
from zerotune.inputs.batch import BatchSemantics
from zerotune.inputs.job import Job, TuneOptions
from zerotune.run.resources import select_resources
from zerotune.strategy import remeasure
from zerotune.strategy.answer import best_experiment
from zerotune.strategy.tuning import Strategy

GiB = 2**30


def make_job(tmp_path: Path, max_mbs: int = 32, gas: int = 1, fast: bool = True, cpu: bool = True,
             precision: float = DEFAULT_PRECISION) -> Job:
    """A job tuning ZeRO stage 0 only, mbs 1..max_mbs, on 2 ranks (CPU ranks unless ``cpu`` is False) with 8 GiB each,
    to ``precision``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                                  "zero_optimization": {"stage": 0},
                                  "autotuning": {"enabled": True, "fast": fast,
                                                 "max_train_micro_batch_size_per_gpu": max_mbs}}))
    return Job.build(str(tmp_path / "train.py"), ["--deepspeed_config", str(config)], select_resources(local_slots=2),
                     TuneOptions(device_memory_bytes=8 * GiB, results_dir=str(tmp_path / "results"), cpu=cpu,
                                 precision=precision))


def run_strategy(tmp_path: Path, curve, max_mbs: int = 32, gas=1, first_runs=None,
                 rel_half_width: float = 0.01, fast: bool = True,
                 boundary_share: float | None = None,
                 precision: float = DEFAULT_PRECISION) -> tuple[list[tuple[int, int, int]], Strategy]:
    """Tune ZeRO stage 0 only, mbs 1..max_mbs, with ``curve(mbs, gas)`` as each run's samples/s
    (``first_runs``: (mbs, gas) -> the first run's samples/s instead, a noisy run), each known to
    ``rel_half_width``, and each spending ``boundary_share`` of its step once per optimizer step
    (None: not measured); ([(stage, mbs, gas)] in the order evaluated, replicas included; the strategy).
    With ``fast`` False the knob phase runs too (every knob setting on the curve's value); ``precision`` the
    tuning's."""
    job = make_job(tmp_path, max_mbs, gas, fast, precision=precision)
    ran = []

    def evaluate(exps):
        for exp in exps:
            exp.status = Status.OK
            if exp.kind is not ExperimentKind.PROFILE:
                first = exp.replica_of is None and (exp.mbs, exp.gas) in (first_runs or {})
                ran.append((exp.stage, exp.mbs, exp.gas))
                exp.metric = first_runs[exp.mbs, exp.gas] if first else curve(exp.mbs, exp.gas)
                exp.metric_rel_half_width = rel_half_width
                exp.boundary_share = boundary_share
        return exps

    strategy = Strategy(job, evaluate)
    strategy.run()
    return ran, strategy


def cpu_like(mbs: int, gas: int) -> float:
    """Samples/s flat from mbs 16 up (50 at mbs 16, 51 at 32), and 3% faster at gas 2 for mbs <= 16: the shape
    measured on this 2-core machine (benchmarks/README.md, real runs of 2026-11-25)."""
    flat = 50.0 + (mbs - 16) / 16 if mbs >= 16 else 50.0 * mbs / 16
    return flat * (1.03 if gas == 2 and mbs <= 16 else 0.98 if gas == 2 else 1.0)


def test_where_throughput_plateaus_the_best_mbs_global_batch_is_split_in_two_and_wins(tmp_path):
    ran, strategy = run_strategy(tmp_path, cpu_like)
    # the mbs search: 32 (the cap), 16 ties it within the noise; the gas phase: 16 at gas 2 (the same
    # global batch as 32 at gas 1) first, then 32 at gas 2
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 16, 2), (0, 32, 2)]
    assert strategy.best_batch == {0: (16, 2)}
    best = max((e for e in strategy.result.experiments if e.metric is not None), key=lambda e: e.metric)
    assert (best.mbs, best.gas, best.metric) == (16, 2, 51.5)


def test_where_throughput_still_climbs_the_split_is_not_tried(tmp_path):
    ran, strategy = run_strategy(tmp_path, lambda mbs, gas: 10.0 * mbs * (1.02 if gas == 2 else 1.0))
    # 16 ran at half the speed of 32: no split, only gas 2 at the best mbs; and no fine pass below 32 either (CPU
    # ranks: the throughput model gates no mbs below its family's largest there, but 16 reads 50% under 32, so
    # even at the far end of their noise nothing between them beats 32 by more than a tie, D311)
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 32, 2)]
    assert strategy.result.predictions == []
    assert strategy.best_batch == {0: (32, 2)}


def test_a_gas_rung_is_not_run_where_the_once_per_step_share_bounds_its_gain_under_the_threshold(tmp_path):
    def climbing(mbs, gas):
        return 10.0 * mbs * (1.02 if gas == 2 else 1.0)

    # 1.9% of each step once per optimizer step: gas 2 gains at most 0.019 / 1.981 = 0.96%: not run
    ran, strategy = run_strategy(tmp_path / "small", climbing, boundary_share=0.019)
    assert ran == [(0, 32, 1), (0, 16, 1)]
    assert strategy.best_batch == {}
    # 2.1%: at most 1.06%: the rung runs (and on this curve wins by 2%, more than the bound: a curve no run can give)
    ran, strategy = run_strategy(tmp_path / "large", climbing, boundary_share=0.021)
    assert ran[-1] == (0, 32, 2) and strategy.best_batch == {0: (32, 2)}


def test_the_split_is_not_run_where_its_doubled_gas_can_gain_under_the_threshold(tmp_path):
    # mbs 16 ties 32 (the split's evidence); at most 0.2% x 16 / 16 of a step once per optimizer step at mbs 16:
    # twice the gas gains at most 0.1%: no split, and no gas 2 at mbs 32 either
    ran, strategy = run_strategy(tmp_path / "small", cpu_like, boundary_share=0.002)
    assert ran == [(0, 32, 1), (0, 16, 1)] and strategy.best_batch == {}
    # 3%: up to 1.5%: both run, as without a measured share
    ran, _ = run_strategy(tmp_path / "large", cpu_like, boundary_share=0.03)
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 16, 2), (0, 32, 2)]


def test_the_gain_of_doubling_gas_is_bounded_by_the_once_per_step_share():
    from zerotune.inputs.batch import doubling_gain_bound
    z0, z3 = {"zero_optimization": {"stage": 0}}, {"zero_optimization": {"stage": 3}}
    # T = g F + B; gas 2g over g: 2 (g F + B) / (2 g F + B) - 1 = s / (2 - s)
    assert doubling_gain_bound(0.02, z0) == 0.02 / 1.98
    assert doubling_gain_bound(0.0002, z3) == 0.0002 / 1.9998
    assert doubling_gain_bound(1.0, z0) == 1.0  # all once per step: gas 2 halves the time per sample
    assert doubling_gain_bound(None, z0) is None
    # ZeRO-1 reduces in the backward's gradient hooks under overlap_comm, where the probe does not time it
    assert doubling_gain_bound(0.001, {"zero_optimization": {"stage": 1, "overlap_comm": True}}) is None
    assert doubling_gain_bound(0.001, {"zero_optimization": {"stage": 1}}) == 0.001 / 1.999
    assert doubling_gain_bound(0.001, {"zero_optimization": {"stage": 3, "overlap_comm": False}}) == 0.001 / 1.999


def test_the_split_keeps_the_global_batch_and_honours_the_semantics():
    free = BatchSemantics(2, gas=1, gas_doubling=True)
    assert free.gas_split(32) == (16, 2)  # 16 x 2 x 2 = 64 = 32 x 1 x 2
    assert BatchSemantics(2, gas=3, gas_doubling=True).gas_split(8) == (4, 6)
    assert free.gas_split(1) is None and free.gas_split(8, lo=5) is None
    assert BatchSemantics(2, gas=1, gas_doubling=True, mbs_values=(8, 32)).gas_split(32) is None  # 16 not listed
    assert BatchSemantics(2, fixed_train_batch_size=64).gas_split(32) is None  # the fixed batch's own candidates
    assert BatchSemantics(2, gas=1, gas_values=(2,)).gas_split(32) is None  # the config's gas list only


def test_a_larger_batch_that_loses_within_the_noise_is_not_re_measured_and_races_the_best_metric(tmp_path):
    # gas 2 at mbs 32 (twice the global batch) is truly 4% faster, but its one run reads 3% slower, known to ±3%
    # only: a loss within the noise is no evidence for the larger batch, so the gas phase keeps gas 1 without
    # re-measuring either side (the ladder stops there), and the finalists are not re-measured either: their own
    # intervals (±4.2% together) are wider than the 3%, so steps would decide, not a launch
    curve = lambda mbs, gas: 10.0 * mbs * (1.04 if gas == 2 else 1.0)  # noqa: E731
    ran, strategy = run_strategy(tmp_path, curve, first_runs={(32, 2): 310.4}, rel_half_width=0.03)
    assert strategy.best_batch == {} and ran[-2:] == [(0, 16, 1), (0, 32, 2)]
    assert not any(e.replica_of for e in strategy.result.experiments)
    assert strategy.result.answer.name == "z0_gas1_tmbspg32"
    # the rung raced the best config's own metric (320 samples/s), not its pessimistic bound
    (rung,) = [e for e in strategy.result.experiments if (e.mbs, e.gas) == (32, 2) and e.replica_of is None]
    assert rung.must_beat == 320.0


def test_a_larger_batch_that_wins_within_the_run_to_run_noise_is_re_measured_only_where_it_could_lose(tmp_path):
    # to a 0.5% precision, gas 2 at mbs 32 is truly 4% faster and its one run reads 1% faster, each run known to
    # ±0.5% (±0.7% together): the runs' own intervals tell them apart, the run-to-run noise does not (±2.9% in
    # all), and the difference's interval reaches 1.9% below zero, past the precision: gas 2 could lose by more
    # than a tie, so both sides are re-measured and the pooled metrics pick gas 2 (323.2 + 332.8 against 320 + 320)
    faster = lambda mbs, gas: 10.0 * mbs * (1.04 if gas == 2 else 1.0)  # noqa: E731
    slower = lambda mbs, gas: 10.0 * mbs * (0.96 if gas == 2 else 1.0)  # noqa: E731
    ran, strategy = run_strategy(tmp_path, faster, first_runs={(32, 2): 323.2}, rel_half_width=0.005, precision=0.005)
    assert ran[-3:] == [(0, 32, 2), (0, 32, 2), (0, 32, 1)]  # the candidate, then both re-measured
    assert strategy.best_batch == {0: (32, 2)}
    # truly 4% slower, the same lucky first run: re-measured, and the pooled metrics keep gas 1 (323.2 + 307.2)
    ran, strategy = run_strategy(tmp_path / "slower", slower, first_runs={(32, 2): 323.2}, rel_half_width=0.005,
                                 precision=0.005)
    assert ran[-3:] == [(0, 32, 2), (0, 32, 2), (0, 32, 1)] and strategy.best_batch == {}
    # to the default 2%, a first run 3% faster known to ±1% (±3.2% in all): at worst gas 2 is 0.2% slower, within
    # the precision, so no launch can move the answer by more than it promises: the reading stands
    ran, strategy = run_strategy(tmp_path / "at_2pct", slower, first_runs={(32, 2): 329.6}, rel_half_width=0.01)
    assert ran[-1] == (0, 32, 2) and ran.count((0, 32, 2)) == 1 and strategy.best_batch == {0: (32, 2)}
    # the same runs known to ±3% (±4.2% together, wider than the 3% win): steps would decide, not a launch
    ran, strategy = run_strategy(tmp_path / "imprecise", slower, first_runs={(32, 2): 329.6}, rel_half_width=0.03)
    assert ran[-1] == (0, 32, 2) and ran.count((0, 32, 2)) == 1 and strategy.best_batch == {0: (32, 2)}


def test_a_split_that_loses_within_the_run_to_run_noise_is_re_measured_only_where_it_could_win(tmp_path):
    # the split keeps the global batch, so a loss within the noise is re-measured too: mbs 16 at gas 2 is truly 6%
    # faster than mbs 32 at gas 1 (53 against 51 samples/s); to a 0.5% precision its one run reads 50.49, 1% slower,
    # within the run-to-run noise of two runs known to ±0.5%, and the difference's interval reaches 1.9% above
    def curve(mbs, gas):
        return cpu_like(mbs, 1) * (1.06 if gas == 2 and mbs <= 16 else 1.0)
    ran, strategy = run_strategy(tmp_path, curve, first_runs={(16, 2): 50.49}, rel_half_width=0.005, precision=0.005)
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 16, 2), (0, 16, 2), (0, 32, 1), (0, 32, 2)]  # split, both re-measured
    assert strategy.best_batch[0] == (16, 2)
    # to the default 2%, a run 2.9% slower known to ±1% (±3.2% in all) could win by 0.3% at most, a tie: no
    # replica; the split's reading loses, and the answer is mbs 32 at gas 1, which ties mbs 16 (51 against 50) and
    # is taken for the better reading (CPU ranks: no capacity for headroom to protect)
    ran, strategy = run_strategy(tmp_path / "at_2pct", curve, first_runs={(16, 2): 49.5}, rel_half_width=0.01)
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 16, 2), (0, 32, 2)] and strategy.best_batch == {}
    assert (strategy.result.answer.name, strategy.result.ledger.tie.reason) == ("z0_gas1_tmbspg32",
                                                                                 "the better reading")
    # known to ±3% each: the runs' own noise blocks, no replica either; nor does the fine pass bisect below mbs 32:
    # mbs 16 reads 2% under it, and no run between them could resolve what it could gain (D322)
    ran, strategy = run_strategy(tmp_path / "imprecise", curve, first_runs={(16, 2): 49.5}, rel_half_width=0.03)
    assert ran == [(0, 32, 1), (0, 16, 1), (0, 16, 2), (0, 32, 2)] and strategy.best_batch == {}


def test_with_fast_false_the_answer_is_reported_on_two_runs(tmp_path):
    # throughput rising with mbs, every run known to ±1%: nothing ties, so nothing is re-measured before the
    # answer; with "fast": false the answer, mbs 32 at gas 2, gets a second run all the same (its first run
    # read 10% high: 704 samples/s for 640), and the pooled 672 is what the summary reports
    curve = lambda mbs, gas: 10.0 * mbs * (2.0 if gas == 2 else 1.0)  # noqa: E731
    ran, strategy = run_strategy(tmp_path, curve, first_runs={(32, 2): 704.0}, fast=False)
    assert ran[-1] == (0, 32, 2) and ran.count((0, 32, 2)) == 2
    answer = best_experiment(strategy.result.experiments, strategy.job.objective)
    assert answer.name == "z0_gas2_tmbspg32" and strategy.pooled(answer.name).value == 672.0
    assert strategy.result.experiments[-1].name == "z0_gas2_tmbspg32_r2"
    # "fast": true: the answer stays on its one run
    ran, strategy = run_strategy(tmp_path / "fast", curve, first_runs={(32, 2): 704.0})
    assert ran.count((0, 32, 2)) == 1


def test_finalists_are_re_measured_only_where_the_run_to_run_noise_blocks_past_a_tie(tmp_path):
    values = {"z0_gas1_tmbspg32": 101.0, "z0_gas1_tmbspg16": 100.0, "z0_gas1_tmbspg32_r2": 99.4,
              "z0_gas1_tmbspg16_r2": 100.0}
    ran = []

    def strategy_with(path, rel_half_width, precision=DEFAULT_PRECISION):
        def evaluate(exps):
            for exp in exps:
                ran.append(exp.name)
                exp.status, exp.metric, exp.metric_rel_half_width = Status.OK, values[exp.name], rel_half_width
            return exps

        strategy = Strategy(make_job(path, precision=precision), evaluate)
        strategy.evaluate([strategy.builder.mbs_experiment(0, m) for m in (32, 16)])
        return strategy

    # to a 0.5% precision, mbs 32 reads 101 and mbs 16 reads 100 (1% apart), each known to +-0.5% on its own steps
    # (+-0.7% together): the runs' intervals tell them apart; the assumed 1% run-to-run noise (+-2.9% in all) does
    # not, and mbs 16 could be 1.9% faster, past the precision: both finalists are re-measured (the best first),
    # and the pooled 100.2 against 100 keeps mbs 32 (a tie to that precision would take the smaller batch)
    strategy = strategy_with(tmp_path / "precise", 0.005, precision=0.005)
    remeasure.confirm_answer(strategy.ev)
    assert strategy.result.run_noise.sigma == RUN_NOISE
    assert ran == ["z0_gas1_tmbspg32", "z0_gas1_tmbspg16", "z0_gas1_tmbspg32_r2", "z0_gas1_tmbspg16_r2"]
    assert strategy.pooled("z0_gas1_tmbspg32").value == pytest.approx(100.2)
    # to the default 2%, 103 against 100, each known to +-1% (+-3.2% in all): mbs 16 is at most 0.2% faster, a tie,
    # so no launch can move the answer by more than the precision: no replica, the better reading is the answer
    values["z0_gas1_tmbspg32"] = 103.0
    ran.clear()
    strategy = strategy_with(tmp_path / "at_2pct", 0.01)
    remeasure.confirm_answer(strategy.ev)
    assert ran == ["z0_gas1_tmbspg32", "z0_gas1_tmbspg16"]
    assert strategy.result.answer.name == "z0_gas1_tmbspg32"
    # each known to +-3% only (+-4.2% together, wider than the 3%): steps would decide, not a launch
    ran.clear()
    strategy = strategy_with(tmp_path / "imprecise", 0.03)
    remeasure.confirm_answer(strategy.ev)
    assert ran == ["z0_gas1_tmbspg32", "z0_gas1_tmbspg16"]
    assert strategy.result.answer.name == "z0_gas1_tmbspg32"


def test_a_smaller_mbs_of_the_answers_config_away_from_capacity_is_not_re_measured(tmp_path):
    # GPU ranks, 8 GiB each; the run-to-run noise reads 4.0% (mbs 8: 80, then 88), so mbs 32 (103) and mbs 16 (100)
    # tie within the noise, and neither is known to +-2%
    values = {"z0_gas1_tmbspg32": 103.0, "z0_gas1_tmbspg16": 100.0, "z0_gas1_tmbspg8": 80.0,
              "z0_gas1_tmbspg8_r2": 88.0, "z0_gas1_tmbspg32_r2": 101.0, "z0_gas1_tmbspg16_r2": 100.0}

    def run(path, peak_of_32):
        ran = []

        def evaluate(exps):
            for exp in exps:
                ran.append(exp.name)
                exp.status, exp.metric, exp.metric_rel_half_width = Status.OK, values[exp.name], 0.01
                exp.peak_memory_bytes = peak_of_32 if exp.mbs == 32 else 4 * GiB
            return exps
        strategy = Strategy(make_job(path, cpu=False), evaluate)
        strategy.evaluate([strategy.builder.mbs_experiment(0, m) for m in (32, 16, 8)])
        strategy.remeasure([strategy.result.experiments[-1]])
        assert strategy.result.run_noise.sigma == pytest.approx(0.0397, abs=1e-4)
        remeasure.confirm_answer(strategy.ev)
        return ran[4:]
    # both ran away from the capacity (7 GiB and 4 GiB of 8: under 0.9): the readings put the larger mbs first, as
    # throughput rises with mbs there; mbs 16 is not re-measured, and nothing else ties: no re-measure at all
    assert run(tmp_path / "calm", 7 * GiB) == []
    # mbs 32 ran at 0.95 of the budget, where the allocator's flushes can slow a step: both are re-measured
    assert run(tmp_path / "near", int(0.95 * 8 * GiB)) == ["z0_gas1_tmbspg32_r2", "z0_gas1_tmbspg16_r2"]


def saturating(mbs: int, gas: int) -> float:
    """Samples/s rising and concave in mbs (a fixed per-step cost amortized), the same at any gas."""
    return 100.0 * mbs / (mbs + 8)


def settled(tmp_path: Path, mbs_values, first_runs) -> tuple[list[str], Strategy]:
    """ZeRO-0 runs at ``mbs_values`` on the :func:`saturating` curve (``first_runs``: mbs -> the first run's samples/s
    instead), each known to ±1%, then the answer settled as a ``"fast": true`` tuning settles it; (the experiments
    run, in order; the strategy)."""
    ran = []

    def evaluate(exps):
        for exp in exps:
            ran.append(exp.name)
            first = exp.replica_of is None and exp.mbs in first_runs
            exp.status, exp.metric_rel_half_width = Status.OK, 0.01
            exp.metric = first_runs[exp.mbs] if first else saturating(exp.mbs, exp.gas)
        return exps

    strategy = Strategy(make_job(tmp_path), evaluate)
    strategy.evaluate([strategy.builder.mbs_experiment(0, m) for m in mbs_values])
    strategy.settle_answer()
    return ran, strategy


def test_with_fast_true_an_answer_reading_above_the_line_through_its_mbs_neighbours_is_measured_again(tmp_path):
    # mbs 28's first run reads 90.0 where the curve gives 77.8: the line through its neighbours mbs 24 (75.0) and 30
    # (78.9) predicts 77.6 at mbs 28, 16% below the read, beyond the noise of three runs known to +-1% with the
    # assumed 1% run-to-run noise (2.7%)
    ran, strategy = settled(tmp_path, (24, 28, 30, 32), {28: 90.0})
    assert ran[4:] == ["z0_gas1_tmbspg28_r2"]
    answer = best_experiment(strategy.result.experiments, strategy.job.objective)
    assert answer.name == "z0_gas1_tmbspg28" and strategy.pooled(answer.name).value == pytest.approx((90 + 700 / 9) / 2)
    # the same curve without the lucky read: mbs 32 is the answer, below the line through mbs 24 and 28 (80.6 at
    # mbs 32: a concave curve falls under its chords' extensions), and it keeps its one run
    ran, strategy = settled(tmp_path / "smooth", (24, 28, 32), {})
    assert ran == ["z0_gas1_tmbspg24", "z0_gas1_tmbspg28", "z0_gas1_tmbspg32"]
    assert not remeasure.answer_stands_out(strategy.ev)
    assert best_experiment(strategy.result.experiments, strategy.job.objective).name == "z0_gas1_tmbspg32"


def test_an_answer_at_the_end_of_the_curve_is_compared_with_the_line_through_its_two_nearest_neighbours(tmp_path):
    # mbs 32, the largest, against the line through mbs 28 (77.8) and 30 (78.9): 80.1 at mbs 32. Extrapolating
    # doubles the weight of mbs 30 and gives mbs 28 a weight of -1, so the prediction's noise counts 1 + 4 times a
    # neighbour's: sqrt(6) x 2.2% = 5.5% with the answer's own. A read of 90.0 (12.4% above) is measured again;
    # one of 84.0 (4.9% above) is not
    ran, _ = settled(tmp_path, (24, 28, 30, 32), {32: 90.0})
    assert ran[4:] == ["z0_gas1_tmbspg32_r2"]
    ran, _ = settled(tmp_path / "within", (24, 28, 30, 32), {32: 84.0})
    assert ran[4:] == []


def test_the_profile_gives_the_memory_model_the_checkpointed_activation_term(tmp_path):
    def evaluate(exps):
        for exp in exps:  # the profile run: the probe priced checkpointing at 300 bytes a sample
            exp.status, exp.metrics = Status.OK, {"num_params": 1_000_000, "activation_mem_per_gpu": 5_000,
                                                  "activation_saved_bytes": 1_000,
                                                  "activation_checkpointed_bytes": 300}
        return exps
    strategy = Strategy(make_job(tmp_path), evaluate)
    strategy.profile()
    prior = strategy.result.memory.prior  # the fit's prior: no run has refitted it yet
    assert (prior.activation_bytes_per_sample, prior.checkpointed_activation_bytes_per_sample) == (1_000, 300)
    assert strategy.result.model_info.checkpointed_activation_mem_per_gpu == 300
