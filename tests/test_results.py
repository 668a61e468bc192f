"""The answer files and the summary: best experiment, cost, optimal config."""
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective
from zerotune.report.results import best_experiment, cost_line, device_seconds, render_table, table_text

THROUGHPUT = Objective.named("throughput")


def exp(name, status, metric=None, wall_s=None, kind=ExperimentKind.MBS, space="z1"):
    return Experiment(name, {"train_micro_batch_size_per_gpu": 1}, num_nodes=2, num_slots=4, kind=kind, space=space,
                      status=status, metric=metric, wall_s=wall_s)


RUNS = [exp("profile_z3", Status.OK, None, 900.0, ExperimentKind.PROFILE, "profile"),
        exp("z1_gas1_tmbspg1", Status.OK, 10.0, 450.0), exp("z1_gas1_tmbspg2", Status.OK, 12.0, 450.0),
        exp("z1_gas1_tmbspg4", Status.OOM, None, 900.0)]


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
    text = table_text(render_table(RUNS, THROUGHPUT, elapsed_s=2700.0, launched=4))
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
    text = table_text(render_table(runs, THROUGHPUT, elapsed_s=1800.0, launched=4))
    assert "12.6 (2 runs, spread 2%)" in text and "z1_gas1_tmbspg2 *" in text
