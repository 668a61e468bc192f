"""The answer files and the summary: best experiment, cost, optimal config."""
import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.noise import RUN_NOISE, RunNoise, mean_half_width, run_noise
from zerotune.core.objective import Objective
from zerotune.report.data import ReportData
from zerotune.report.notes import run_length_note
from zerotune.report.results import (
    answer_text,
    cost_line,
    device_seconds,
    print_wide,
    render_table,
    saver_names,
    startup_line,
    table_text,
    unplanned_lines,
)
from zerotune.strategy.answer import best_experiment

THROUGHPUT = Objective.named("throughput")


def report(runs, *, answer, elapsed_s=300.0, since=None):
    """The report's model of ``runs`` with ``answer`` (the ledger's), as the tuner builds it."""
    return ReportData(list(runs), THROUGHPUT, None, None, answer, Path("exps"), since=since, elapsed_s=elapsed_s)


def exp(name, status, metric=None, wall_s=None, kind=ExperimentKind.MBS, space="z1"):
    return Experiment(name, {"train_micro_batch_size_per_gpu": 1}, num_nodes=2, num_slots=4, kind=kind, space=space,
                      status=status, metric=metric, wall_s=wall_s)


RUNS = [exp("profile_z3", Status.OK, None, 900.0, ExperimentKind.PROFILE, "profile"),
        exp("z1_gas1_tmbspg1", Status.OK, 10.0, 450.0), exp("z1_gas1_tmbspg2", Status.OK, 12.0, 450.0),
        exp("z1_gas1_tmbspg4", Status.OOM, None, 900.0)]


def test_savers_and_parallel_degrees_are_named_in_the_savers_phases_order_for_the_summary_and_plots():
    from zerotune.report.html import series_label
    every = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
             "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 4,
             "gradient_checkpointing": True,
             "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "offload_param": {"device": "none"},
                                   "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    assert saver_names(every) == ["bf16 states", "AutoTP 2", "Ulysses 4", "checkpointing",
                                  "offload optimizer (cpu, ratio 0.5)", "hpZ 8"]
    plain = {"tensor_parallel": {"autotp_size": 1}, "sequence_parallel_size": 1,
             "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8, "offload_optimizer": {"device": "cpu"}}}
    assert saver_names(plain) == ["offload optimizer (cpu)"]  # hpZ is stage 3's; degree 1 is none
    run = Experiment("z1_gas2_tmbspg4_sp4", {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                             "sequence_parallel_size": 4, "zero_optimization": {"stage": 1}})
    assert series_label(run) == "ZeRO 1 + Ulysses 4, gas 2"  # its own curve in the throughput plot


def test_cost_is_wall_time_times_devices():
    assert device_seconds(RUNS[1]) == 450.0 * 8
    # 2700 s x 8 devices = 6 device-hours; the OOM (900 s) is a third of it
    assert cost_line(RUNS) == "tuning cost: 6 device-hours (wall time x devices), 33% of it on experiments that did not finish ok"


def test_cost_gives_the_share_of_runs_ended_early():
    runs = [*RUNS, exp("z1_gas1_tmbspg3", Status.OK, 11.0, 450.0), exp("z1_gas1_tmbspg3_r2", Status.OK, 11.0, 450.0)]
    runs[-2].ended, runs[-1].ended, runs[1].ended = "cannot_beat", "precise", "step_cap"
    # 3600 s x 8 = 8 device-hours; the two ended early, 900 s of 3600 s, are a quarter of it
    assert cost_line(runs) == ("tuning cost: 8 device-hours (wall time x devices), 25% of it on experiments that did "
                               "not finish ok, 25% on 2 ended early (precise or cannot beat the best)")


def test_best_ignores_the_profile_and_failures():
    assert best_experiment(RUNS, THROUGHPUT).name == "z1_gas1_tmbspg2"
    assert best_experiment(RUNS, Objective.named("latency")).name == "z1_gas1_tmbspg1"


def test_summary_rows_carry_device_hours():
    text = table_text(render_table(report(RUNS, elapsed_s=2700.0, answer=best_experiment(RUNS, THROUGHPUT))))
    z1 = next(line for line in text.splitlines() if line.startswith("│ z1 "))
    assert [c.strip() for c in z1.split("│")[1:-1]] == ["z1", "3", "2", "1 oom", "4", "12", "z1_gas1_tmbspg2 *"]
    assert "tuning cost: 6 device-hours" in text


def test_the_answer_is_the_best_pooled_metric_over_re_measurements():
    lucky = exp("z1_gas1_tmbspg4", Status.OK, 14.0, 450.0)  # one lucky run...
    again = exp("z1_gas1_tmbspg4_r2", Status.OK, 10.0, 450.0)  # ...re-measured: pooled 12.0
    again.replica_of = lucky.name
    steady = exp("z1_gas1_tmbspg2", Status.OK, 12.5, 450.0)
    steady_again = exp("z1_gas1_tmbspg2_r2", Status.OK, 12.7, 450.0)
    steady_again.replica_of = steady.name
    runs = [lucky, again, steady, steady_again]
    assert best_experiment(runs, THROUGHPUT) is steady
    text = table_text(render_table(report(runs, elapsed_s=1800.0, answer=best_experiment(runs, THROUGHPUT))))
    assert "12.6 (2 runs, spread 2%)" in text and "z1_gas1_tmbspg2 *" in text


GIB = 2 ** 30
BUDGET = 80 * GIB


def gpu_run(stage, mbs, metric, hw, peak_gib, gas=1):
    e = Experiment(f"z{stage}_gas{gas}_tmbspg{mbs}", {"train_micro_batch_size_per_gpu": mbs,
                                                      "gradient_accumulation_steps": gas,
                                                      "zero_optimization": {"stage": stage}},
                   num_nodes=1, num_slots=8, kind=ExperimentKind.MBS, space=f"z{stage}", status=Status.OK,
                   metric=metric, wall_s=100.0)
    e.metric_rel_half_width, e.peak_memory_bytes = hw, int(peak_gib * GIB)
    return e


def test_on_gpu_ranks_a_calm_fall_in_mbs_is_noise_and_the_answer_is_the_larger_mbs():
    # mbs 15 reads 0.35% under mbs 10, both peaked under 0.9 of the budget (0.53 and 0.75), where throughput rises
    # with mbs: the two runs are worth 402.0 at 15, the answer. mbs 20 ran at 0.95 of the budget, where allocator
    # flushes can slow a step: it stands alone, at its 395.0.
    small, large, near = gpu_run(3, 10, 402.7, 0.005, 42), gpu_run(3, 15, 401.3, 0.015, 60), gpu_run(3, 20, 395.0, 0.01, 76)
    runs = [small, large, near]
    assert best_experiment(runs, THROUGHPUT, BUDGET) is large
    assert best_experiment(runs, THROUGHPUT) is small  # CPU ranks (no budget to read capacity against): the reading
    text = table_text(render_table(report(runs, elapsed_s=300.0, answer=best_experiment(runs, THROUGHPUT, BUDGET))))
    z3 = next(line for line in text.splitlines() if line.startswith("│ z3 "))
    assert z3.split("│")[-2].strip() == "z3_gas1_tmbspg15 *"  # the table stars the answer as its space's best
    assert "Optimal: z3_gas1_tmbspg15 (ZeRO stage 3, mbs 15, gas 1), throughput 401.3" in answer_text(report(runs, answer=large))


def test_each_config_is_its_own_curve_and_a_run_near_capacity_its_own_reading():
    small, slower = gpu_run(3, 10, 402.7, 0.005, 42), gpu_run(3, 15, 380.0, 0.005, 60)  # worth (402.7 + 380) / 2 at 15
    other_gas = gpu_run(3, 16, 395.0, 0.005, 60, gas=2)  # a curve of its own, worth 395.0
    assert best_experiment([small, slower, other_gas], THROUGHPUT, BUDGET) is other_gas
    other_gas.metric = 390.0  # under 391.35
    assert best_experiment([small, slower, other_gas], THROUGHPUT, BUDGET) is slower
    # the best reading at 0.91 of the budget stands alone, above the calm 15
    near_best = gpu_run(3, 10, 402.7, 0.005, 73)
    assert best_experiment([near_best, gpu_run(3, 15, 401.3, 0.015, 60)], THROUGHPUT, BUDGET) is near_best
    fast, slow = gpu_run(3, 10, 1.000, 0.005, 42), gpu_run(3, 15, 1.003, 0.005, 60)  # latency: seconds per step
    assert best_experiment([fast, slow], Objective.named("latency"), BUDGET) is fast


def test_the_answer_is_reported_with_the_run_to_run_noise_of_the_configs_run_twice():
    # z1 mbs 4 ran twice, 10 and 11: on the log scale the deviations are +-ln(1.1)/2; each run's own +-1%
    # explains (0.01 / 2) ** 2 of each, less a half for the pair's own mean: the runs give
    # v = ln(1.1) ** 2 / 2 - 2.5e-05; with the 1% prior worth 2 degrees of freedom, sigma ** 2 = (2e-4 + v) / 3
    slow, slow_again = exp("z1_gas1_tmbspg4", Status.OK, 10.0, 450.0), exp("z1_gas1_tmbspg4_r2", Status.OK, 11.0, 450.0)
    slow_again.replica_of = slow.name
    best = exp("z1_gas1_tmbspg8", Status.OK, 12.0, 450.0)
    for e in (slow, slow_again, best):
        e.metric_rel_half_width = 0.01
    runs = [RUNS[0], slow, slow_again, best]
    v = math.log(1.1) ** 2 / 2 - 2.5e-05
    sigma = math.sqrt((2 * 0.01 ** 2 + v) / 3)
    noise = run_noise(runs)
    assert (noise.configs, noise.df) == (1, 1)
    assert noise.measured == pytest.approx(math.sqrt(v)) and noise.sigma == pytest.approx(sigma)  # 6.7%, 3.97%
    # the answer's one run, +-1% on its own steps, is what a run of it gives to +-sqrt(0.01 ** 2 + (2 sigma) ** 2)
    assert mean_half_width([0.01], noise.sigma) == pytest.approx(math.sqrt(0.01 ** 2 + 4 * sigma ** 2))  # 8.0%
    text = answer_text(report(runs, answer=best))
    assert text.startswith("\nOptimal: z1_gas1_tmbspg8 (") and "throughput 12 ±8.0% samples/s (95%, mean of 1 run(s)" in text
    assert "run-to-run noise: sigma 4.0%, from 1 config(s) run more than once (1 degree(s) of freedom; the runs " \
           "alone give 6.7%)" in text


def test_the_run_to_run_noise_is_assumed_until_a_config_runs_twice_and_never_below_the_floor():
    assert run_noise(RUNS) == RunNoise(RUN_NOISE)  # one run each; the profile, a failure and an OOM count nothing
    twice, again = exp("z1_gas1_tmbspg2", Status.OK, 12.0, 450.0), exp("z1_gas1_tmbspg2_r2", Status.OK, 12.0, 450.0)
    again.replica_of = twice.name
    failed = exp("z1_gas1_tmbspg2_r3", Status.FAILED, None, 450.0)
    failed.replica_of = twice.name
    noise = run_noise([twice, again, failed])
    # two equal runs: the runs give 0, the prior alone sqrt(2e-4 / 3) = 0.8%, floored at 1%
    assert noise == RunNoise(RUN_NOISE, configs=1, df=1, measured=0.0)
    assert mean_half_width([0.01, 0.03], 0.01) == pytest.approx(math.sqrt((0.0005 + 0.0004) / 2))
    with pytest.raises(ValueError):
        mean_half_width([], 0.01)


def test_the_notes_say_what_was_not_launched_and_what_the_re_measurements_changed():
    from zerotune.report.notes import strategy_notes
    from zerotune.strategy.ledger import Ledger
    from zerotune.strategy.prediction import Prediction
    from zerotune.strategy.result import StrategyResult

    def run(name, stage, metric, replica_of=None):
        cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}}
        return Experiment(name, cfg, status=Status.OK, metric=metric, replica_of=replica_of)

    ledger = Ledger(Objective.named("throughput"))
    # z1 reads 2% above z0 on its first run; its second run reads 6% under: pooled 98, z0 is the answer
    for exp in (run("z0", 0, 100.0), run("z1", 1, 102.0), run("z1_r2", 1, 94.0, replica_of="z1")):
        ledger.add(exp)
    result = StrategyResult(ledger=ledger)
    result.predictions.append(Prediction("z0_mbs4", 49.0, 51.0, 100.0, "z0", 0.02, "1 run(s) of its family"))
    notes = strategy_notes(result, 2**30, 1)
    assert notes[0] == ("not launched: z0_mbs4: throughput model: 49-51 samples/s predicted (1 run(s) of its "
                        "family); cannot beat z0's 100 by more than the precision (2%): not launched")
    assert notes[1] == ("re-measurements: 1 run(s) of z1 (where one run could not tell configs apart by more than "
                        "the target precision); they changed the answer from z1 to z0")
    ledger.add(run("z0_r2", 0, 90.0, replica_of="z0"))  # z0 pooled 95 < z1's 98: the first runs' answer again
    assert strategy_notes(result, 2**30, 1)[1].endswith("; the first runs alone give the same answer")


LONG = "z1_gas1_tmbspg14_rbs500000000_agbs500000000_overlap_comm_true_contiguous_gradients_false_round_robin_true"


def test_the_summary_is_whole_when_the_output_is_not_a_terminal():
    """A CI log or `| tee` (rich assumes 80 columns there) and summary.txt get every name whole, on one line."""
    runs = [exp("profile_z3", Status.OK, None, 900.0, ExperimentKind.PROFILE, "profile"),
            exp(LONG, Status.OK, 12.0, 450.0, space="z1_knobs")]
    table = render_table(report(runs, elapsed_s=10.0, answer=runs[1]))
    out = io.StringIO()
    console = Console(file=out)
    assert not console.is_terminal and console.width == 80
    print_wide(console, table)
    assert f" {LONG} * " in out.getvalue() and "…" not in out.getvalue()
    assert f" {LONG} * " in table_text(table) and "…" not in table_text(table)


def launch(name, startup_s, wall_s, how, note="", started_at=1000.0, status=Status.OK):
    e = exp(name, status, 10.0 if status is Status.OK else None, wall_s)
    e.startup_s, e.measure_s = startup_s, None if startup_s is None else wall_s - startup_s - 0.5
    e.launch, e.launch_note, e.started_at = how, note, started_at
    return e


WENT_AWAY = "re-run cold: its warm server went away during the run"
NO_SERVER = "launched cold: the warm server did not start"


def test_the_start_up_line_gives_the_share_of_launch_seconds_and_how_the_launches_started():
    warm = [launch("z1_gas1_tmbspg1", 2.0, 10.0, "warm", started_at=1000.0),
            launch("z1_gas1_tmbspg2", 1.5, 10.0, "warm"), launch("z1_gas1_tmbspg4", 1.0, 10.1, "warm")]
    assert startup_line(warm) == "start-up: 15% of launch seconds (4.5 s of 30.1 s over 3 launches); launches: 3 warm"
    runs = [*warm, launch("z1_gas1_tmbspg8", 6.0, 12.0, "cold", WENT_AWAY),
            launch("z1_gas1_tmbspg16", None, 3.0, "warm", status=Status.OOM),  # no step: counted warm, not timed
            launch("z1_gas1_tmbspg6", 6.0, 12.0, "cold", NO_SERVER), launch("z1_gas1_tmbspg7", 6.0, 12.0, "cold",
                                                                             WENT_AWAY),
            launch("z1_gas1_tmbspg12", 100.0, 200.0, "cold", started_at=500.0)]  # reused: an earlier tuning's launch
    # since the tuning's start at 1000: (4.5 + 18) s of (30.1 + 36) s = 34%, over the 6 launches with both
    assert startup_line(runs, since=1000.0) == (
        f"start-up: 34% of launch seconds (22.5 s of 66.1 s over 6 launches); launches: 4 warm, 3 cold ({WENT_AWAY}; "
        f"{NO_SERVER})")
    # without a start: every launch, the reused one's 100 s of 200 s included
    assert startup_line(runs).startswith("start-up: 46% of launch seconds (122.5 s of 266.1 s over 7 launches); "
                                         "launches: 4 warm, 4 cold (")
    cold = [launch("z1_gas1_tmbspg1", 5.0, 10.0, "cold")]  # warm launches off: no note
    assert startup_line(cold) == "start-up: 50% of launch seconds (5.0 s of 10.0 s over 1 launch); launches: 1 cold"
    cold[0].launch = ""  # a backend that does not say how its ranks started
    assert startup_line(cold) == "start-up: 50% of launch seconds (5.0 s of 10.0 s over 1 launch)"
    text = table_text(render_table(report(runs, elapsed_s=300.0, answer=runs[0], since=1000.0)))
    lines = [line.rstrip() for line in text.splitlines()]  # the caption, wrapped at the table's width
    caption = " ".join(lines[lines.index(cost_line(runs)) + 1:])
    assert caption == (f"start-up: 34% of launch seconds (22.5 s of 66.1 s over 6 launches); launches: 4 warm, "
                              f"3 cold ({WENT_AWAY}; {NO_SERVER})")


def test_a_summary_without_start_up_times_has_no_start_up_line():
    """The simulated backend measures no start-up: its summaries stay as they were."""
    assert startup_line(RUNS) is None
    reused = [launch("z1_gas1_tmbspg1", 2.0, 10.0, "warm", started_at=500.0)]
    assert startup_line(reused, since=1000.0) is None  # a rerun that launched nothing
    text = table_text(render_table(report(RUNS, elapsed_s=2700.0, answer=RUNS[2], since=0.0)))
    assert "start-up" not in text and "launches:" not in text


def cpu_run(stage, mbs, metric, peak_gib, gas=1):
    e = Experiment(f"z{stage}_gas{gas}_tmbspg{mbs}", {"train_micro_batch_size_per_gpu": mbs,
                                                      "gradient_accumulation_steps": gas,
                                                      "train_batch_size": 2 * mbs * gas,
                                                      "zero_optimization": {"stage": stage}},
                   num_slots=2, kind=ExperimentKind.MBS, space=f"z{stage}", status=Status.OK, metric=metric)
    e.peak_memory_bytes = int(peak_gib * GIB)
    return e


def test_configs_within_the_precision_tie_and_the_tie_order_takes_one_without_a_launch():
    from zerotune.strategy.answer import decide
    # z0 mbs 16 reads best (100.0); z1 mbs 16 is 1.5% under it, within the 2% precision: a tie. z2 mbs 16 reads 3%
    # under: no tie. Without a budget (CPU ranks) the better reading takes it.
    z0, z1, z2 = cpu_run(0, 16, 100.0, 2.4), cpu_run(1, 16, 98.5, 2.0), cpu_run(2, 16, 97.0, 1.5)
    answer, tie = decide([z0, z1, z2], THROUGHPUT, precision=0.02)
    assert answer is z0 and tie.answer is z0 and tie.value == 100.0 and tie.others == ((z1, 98.5),)
    assert tie.reason == "the better reading"
    assert decide([z0, z1, z2], THROUGHPUT, precision=0.01) == (z0, None)  # 1.5% is no tie at 1%
    assert decide([z0, z1, z2], THROUGHPUT) == (z0, None)  # no precision: no ties
    # under a 2.6 GiB budget z0's 2.4 GiB peak is near the capacity (92%, at least 90%) and z1's is more than 5%
    # lower: more headroom takes z1
    answer, tie = decide([z0, z1, z2], THROUGHPUT, int(2.6 * GIB), precision=0.02)
    assert answer is z1 and tie.answer is z1 and tie.value == 98.5 and tie.others == ((z0, 100.0),)
    assert tie.reason == "more memory headroom"
    # under 3 GiB z0 runs calm (80%): a lower peak buys nothing, the better reading
    assert decide([z0, z1], THROUGHPUT, 3 * GIB, precision=0.02)[0] is z0
    # near the capacity, but the peaks within 5% of each other: the better reading
    z1.peak_memory_bytes = int(2.35 * GIB)
    answer, tie = decide([z0, z1], THROUGHPUT, int(2.6 * GIB), precision=0.02)
    assert answer is z0 and tie.reason == "the better reading"
    # a three-way tie: z1 mbs 16 (2.0 GiB, calm) for its headroom over z0 (near the capacity); z0 mbs 15, with a
    # peak lower still, does not displace it: z1 runs calm, and it reads better
    three = [z0, cpu_run(1, 16, 99.5, 2.0), cpu_run(0, 15, 99.0, 1.95)]
    answer, tie = decide(three, THROUGHPUT, int(2.6 * GIB), precision=0.02)
    assert answer is three[1] and [e for e, _ in tie.others] == [three[0], three[2]]
    assert tie.reason == "more memory headroom"


def test_a_tied_reading_known_only_to_more_than_3x_the_precision_counts_at_its_lower_bound():
    from zerotune.strategy.answer import decide
    # issue 52's held-out tunings: a config read once to ±20.9% (its run's own interval) 0.2% over one read three
    # times, each to ±0.7%; the run-to-run noise of 1% (nothing re-measured disagrees)
    wide, narrow = cpu_run(0, 16, 30.06, 1.0, gas=2), cpu_run(0, 14, 30.0, 1.0)
    wide.metric_rel_half_width, narrow.metric_rel_half_width = 0.209, 0.007
    replicas = []
    for i in (1, 2):
        r = cpu_run(0, 14, 30.0, 1.0)
        r.name, r.replica_of, r.metric_rel_half_width = f"{narrow.name}_r{i}", narrow.name, 0.007
        replicas.append(r)
    answer, tie = decide([wide, narrow, *replicas], THROUGHPUT, precision=0.02)
    # wide: sqrt(0.209^2 + 0.02^2) = 21.0%, over 3 x 2%: it counts at its lower bound, 23.75; narrow over 3 runs:
    # sqrt((0.007^2 + 0.02^2) / 3) = 1.22%: at its reading, 30.0
    assert (answer, tie.reason, [e for e, _ in tie.others]) == (narrow, "the better lower bound", [wide])
    assert (round(tie.half_widths[wide.name], 4), round(tie.half_widths[narrow.name], 4)) == (0.21, 0.0122)


def test_the_summary_and_the_report_say_tie_with_both_figures(tmp_path):
    from zerotune.report.data import ReportData, TrainingPlan
    from zerotune.report.notes import strategy_notes
    from zerotune.strategy.ledger import Ledger
    from zerotune.strategy.result import StrategyResult

    budget = int(2.6 * GIB)  # z0's 2.4 GiB peak runs near the capacity
    ledger = Ledger(THROUGHPUT, budget, precision=0.02)
    for e in (cpu_run(0, 16, 100.0, 2.4), cpu_run(1, 16, 98.5, 2.0)):
        ledger.add(e)
    result = StrategyResult(ledger=ledger)
    assert strategy_notes(result, budget, 2) == [
        "tie: z1_gas1_tmbspg16 98.5 ±2.0% samples/s, peak 2.00 GiB and z0_gas1_tmbspg16 100 ±2.0% samples/s, peak "
        "2.40 GiB read within --precision 2.0% of each other; the answer is z1_gas1_tmbspg16, for more memory headroom "
        "(the tie order: more memory headroom where a tied config runs near the device's capacity, else the better "
        "reading, a reading known only to more than 3x the precision counting at its lower bound (less its 95% "
        "half-width); no run breaks a tie)"]
    data = ReportData.from_tuning(ledger.experiments, result, objective=THROUGHPUT, budget_bytes=budget,
                                  capacity_bytes=budget, exps_dir=tmp_path, context={}, notes=[], state="finished",
                                  plan=TrainingPlan())
    runner = data.runner_up()
    assert (data.answer.name, runner.name, runner.tie, round(runner.gain, 4)) == (
        "z1_gas1_tmbspg16", "z0_gas1_tmbspg16", True, -0.015)


def test_runs_the_scripts_end_cut_short_say_how_many_more_steps_and_which_flag():
    def run(name, hw, steps, ended="script_end"):
        return Experiment(name, {"train_micro_batch_size_per_gpu": 1}, status=Status.OK, metric=10.0,
                          metric_rel_half_width=hw, steady_steps=steps, ended=ended)
    answer, noisy, precise = run("z0_a", 0.08, 12), run("z0_b", 0.2, 10), run("z0_c", 0.015, 12, "precise")
    runs = [answer, noisy, precise]
    # the answer: 12 * ((0.08 / 0.02) ** 2 - 1) = 180 more steady steps
    assert run_length_note(runs, answer, 0.02, "--max_steps", raised=False) == (
        "run length: 2 of 3 run(s) ended at the script's own last step before the precision (±2.0%); the answer, "
        "z0_a, was known to ±8.0% over 12 steady steps, and about 180 more (its step times' measured variance) would "
        "have reached ±2.0%; the command's --max_steps sets the script's length: with \"autotuning\": "
        "{\"max_steps_arg\": \"--max_steps\"} zerotune raises it for its runs")
    # the answer ran to the precision: the least precise run, 10 * ((0.2 / 0.02) ** 2 - 1) = 990
    line = run_length_note(runs, precise, 0.02, None, raised=False)
    assert "the least precise, z0_b, was known to ±20.0% over 10 steady steps, and about 990 more" in line
    assert line.endswith("name the script's flag for its length in steps as autotuning.max_steps_arg (such as "
                         "\"--max_steps\") and zerotune raises it for its runs")
    assert run_length_note(runs, answer, 0.02, "--steps", raised=True).endswith(
        "--steps was raised for them (autotuning.max_steps_arg), yet the script ended first: check that --steps sets "
        "its length")
    assert run_length_note([precise, run("z0_d", 0.08, 12, "step_cap")], precise, 0.02, "--steps", False) is None


def test_each_launch_beyond_the_cost_plan_says_which_rule_bought_it():
    runs = [Experiment("profile", {}, kind=ExperimentKind.PROFILE, status=Status.OK),
            Experiment("z0_a", {}, status=Status.OK, bought_by="ZeRO stages and mbs: ZeRO stage 0: its mbs search"),
            Experiment("z0_b", {}, status=Status.OOM, bought_by="ZeRO stages and mbs: ZeRO stage 0: the fine pass"),
            Experiment("z0_a_r2", {}, status=Status.OK, replica_of="z0_a", bought_by="gas: a re-measurement"),
            Experiment("z1_c", {}, status=Status.REFUSED), Experiment("z1_d", {}, status=Status.OK),
            Experiment("z2_e", {}, status=Status.SKIPPED), Experiment("z2_f", {})]  # never launched
    assert unplanned_lines(frozenset({"z0_a", "z1_d"}), runs) == [
        "not in the plan: z0_b (oom), bought by ZeRO stages and mbs: ZeRO stage 0: the fine pass",
        "not in the plan: z0_a_r2 (ok), bought by gas: a re-measurement"]


def test_an_answer_known_to_over_3x_the_precision_says_what_dominates_and_what_would_narrow_it():
    # issue 52's held-out answer: one run known to +-20.9% over 40 steady steps, the script's end first, the noise
    # assumed (1%): its own interval dominates, and 40 * ((0.209 / 0.02) ** 2 - 1) = 4328.1 more steps reach +-2%
    wide = exp("z0_gas1_tmbspg14", Status.OK, 30.0, 60.0, space="z0")
    wide.metric_rel_half_width, wide.steady_steps, wide.ended = 0.209, 40, "script_end"
    data = ReportData([RUNS[0], wide], THROUGHPUT, None, None, wide, Path("exps"), precision=0.02)
    assert answer_text(data).splitlines()[-1] == (
        "imprecise: the answer is known to ±21.0%, over 3x the precision (±2.0%): its run's own interval dominates "
        "(z0_gas1_tmbspg14: ±20.9% over 40 steady steps, ended: script_end); about 4329 more steady steps would "
        "reach it (the script's length or autotuning.end_profile_step bounds them)")
    # its own steps at +-1% and a run-to-run noise of 4% (two runs of another config, 10 and 11): only runs
    # average that down, (0.01 ** 2 + (2 * 0.0397) ** 2) / 0.02 ** 2 = 16 of them
    slow, again, best = (exp(n, Status.OK, m, 450.0) for n, m in
                         (("z1_gas1_tmbspg4", 10.0), ("z1_gas1_tmbspg4_r2", 11.0), ("z1_gas1_tmbspg8", 12.0)))
    again.replica_of = slow.name
    for e in (slow, again, best):
        e.metric_rel_half_width = 0.01
    data = ReportData([RUNS[0], slow, again, best], THROUGHPUT, None, None, best, Path("exps"), precision=0.02)
    assert answer_text(data).splitlines()[-1] == (
        "imprecise: the answer is known to ±8.0%, over 3x the precision (±2.0%): the run-to-run noise dominates "
        "(sigma 4.0% over 1 run(s)); about 16 runs of it would average it down to the precision (more steps would "
        "not)")
    # known to within 3x the precision: no line
    data = ReportData([RUNS[0], slow, again, best], THROUGHPUT, None, None, best, Path("exps"), precision=0.03)
    assert "imprecise" not in answer_text(data)
