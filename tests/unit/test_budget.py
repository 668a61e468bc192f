"""The launch budget (--max-launches, --max-device-hours): the tuning launches no more, answers with the best of
what ran and says what it did not decide (zerotune/inputs/budget.py) and by how much the answer could be beaten
(zerotune/strategy/stop_bound.py)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.simulated import tune_simulated
from tests.helpers.tiny import SCRIPT, TINY, write_config
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.inputs.budget import LaunchBudget
from zerotune.inputs.job import Job, TuneOptions
from zerotune.run.resources import select_resources
from zerotune.strategy.result import StrategyResult
from zerotune.strategy.tuning import Strategy


def test_the_budget_counts_launches_and_their_device_hours_never_what_was_not_launched():
    def run(name, status, wall_s=None, slots=2):
        return Experiment(name, {}, num_slots=slots, status=status, wall_s=wall_s)
    done = [run("profile", Status.OK, 36.0), run("a", Status.OOM, 72.0), run("b", Status.OK, 1800.0, slots=4),
            run("c", Status.REFUSED), run("d", Status.SKIPPED)]
    # 3 launches: 36 x 2 + 72 x 2 + 1800 x 4 = 7,416 device-seconds, 2.06 device-hours
    assert LaunchBudget.spent(done) == (3, pytest.approx(2.06))
    assert LaunchBudget(max_launches=5).room(done) == 2 and LaunchBudget(max_launches=3).room(done) == 0
    assert LaunchBudget().room(done) is None  # no limit
    assert LaunchBudget(max_device_hours=2.06).room(done) == 0  # reached: a launch's cost is known only after it
    assert LaunchBudget(max_launches=9, max_device_hours=3).room(done) == 6
    assert LaunchBudget(max_launches=5).describe(done) == "3 of --max-launches 5 launches, 2.06 device-hours"


def test_a_simulated_tuning_launches_exactly_its_budget_and_answers_with_the_best_that_ran(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "cut").mkdir()
    full, _, _ = tune_simulated(tmp_path / "full", 0, True, "all")
    rows, decisions, answer = tune_simulated(tmp_path / "cut", 0, True, "all", max_launches=4)
    def status(row):  # (stage, mbs, gas, status, ...); the profile's row starts with "profile"
        return row[4] if row[0] == "profile" else row[3]
    launched = [r for r in rows if status(r) not in (Status.REFUSED.value, Status.SKIPPED.value)]
    assert len(launched) == 4 and len(full) > len(rows)  # the profile and three runs, of the whole tuning's more
    assert rows == full[:len(rows)]  # the same tuning, stopped
    ok = [r for r in launched if r[0] != "profile" and status(r) == Status.OK.value]
    assert answer[:3] in [r[:3] for r in ok]  # the answer is one that ran ok
    summary = (tmp_path / "cut" / "r" / "summary.txt").read_text()
    text = " ".join(summary.split())
    assert "stopped early: the launch budget is spent (4 of --max-launches 4 launches" in text
    assert "not decided: ZeRO stages and mbs, memory savers, gas, the fine pass, the answer's re-measurement" in text
    # what the stop left and the bound (zerotune/strategy/stop_bound.py): the answer, ZeRO-0 mbs 25, reads 404.7 +-2.5%;
    # mbs 17 (397-414) could beat it by its gain plus sqrt(2.5% ** 2 + its 2.2% ** 2), +3.4%, more than the 2%
    # precision: a finalist left unconfirmed; the stages with no run are bounded by ZeRO-0's compute roofline,
    # 458.1 / (404.7 x (1 - 2.5%)) - 1 = +16.1%
    assert ("not decided: ZeRO stage 0 mbs 1-16, 18-24, 26-30 not run (ran 17, 25); ZeRO stage 1 mbs 1-30 not run; "
            "ZeRO stage 2 mbs 1-30 not run; ZeRO stage 3 mbs 1-30 not run; memory savers; gas; measured configs that "
            "could still beat the answer by more than the precision, not re-measured: z0_gas1_tmbspg17_fp1 ") in text
    assert ("what ran or the throughput model bounds could beat the answer by at most 16.1%: z0_gas1_tmbspg25_fp1 reads "
            "404.7 samples/s ±2.5%; a measured config by at most +3.4% (z0_gas1_tmbspg17_fp1: 397-414 samples/s, 1 "
            "run(s)); an unmeasured one by at most +16.1% (z1_gas1_tmbspg30_fp1: at most 458.1 samples/s, the compute "
            "roofline of a measured family) (95% intervals and the throughput model; docs/decisions.md, D310)") in text
    assert "not bounded by the throughput model" not in text
    # without a budget the summary sets what the tuning planned once the profile ran (the dry run's plan on the
    # profiled memory model, 4 launches at the profile's 290 device-seconds each) against what it spent
    full_text = " ".join((tmp_path / "full" / "r" / "summary.txt").read_text().split())
    assert ("cost plan: 4 launch(es), 0.322 device-hours planned once the profile ran (the strategy on its memory "
            "model, each launch at the profile's device-seconds); spent 9 launch(es) (0 re-measurement(s)), 0.806 "
            "device-hours") in full_text
    # each launch the plan did not name says which rule bought it: the plan's first run, ZeRO-0 at mbs 34, ran
    # out of memory as planned; everything after it was bought by the search from there
    assert [line.rstrip() for line in (tmp_path / "full" / "r" / "summary.txt").read_text().splitlines()
            if line.startswith("not in the plan")] == [
        f"not in the plan: {name} (ok), bought by ZeRO stages and mbs: ZeRO stage {name[1]}: {rule}" for name, rule in [
            ("z0_gas1_tmbspg17_fp1", "its mbs search"), ("z0_gas1_tmbspg25_fp1", "its mbs search"),
            ("z1_gas1_tmbspg25_fp1", "its probe"), ("z2_gas1_tmbspg25_fp1", "its probe"),
            ("z2_gas1_tmbspg29_fp1", "its mbs search"), ("z3_gas1_tmbspg29_fp1", "its probe"),
            ("z3_gas1_tmbspg27_fp1", "its probe"), ("z2_gas1_tmbspg27_fp1", "the fine pass")]]


def test_a_later_stop_bounds_an_unmeasured_mbs_by_its_family_under_the_compute_roofline(tmp_path):
    rows, _, answer = tune_simulated(tmp_path, 0, True, "all", max_launches=8)
    assert [r[:4] for r in rows][-3:] == [(2, 25, 1, "ok"), (2, 29, 1, "ok"), (3, 29, 1, "ok")] and answer[:3] == (2, 25, 1)
    text = " ".join((tmp_path / "r" / "summary.txt").read_text().split())
    # ZeRO-1 mbs 30: its family's one run (mbs 25) allows 458.1 or more by perfect scaling; ZeRO-0's runs at mbs 17
    # and 25 cap every config at their roofline, 458.1 samples/s: 458.1 / (417 x (1 - 2.1%)) - 1 = +12.2%
    assert ("ZeRO stage 2 mbs 1-24, 26-28, 30 not run (ran 25, 29); ZeRO stage 3 mbs 1-28, 30 not run (ran 29); memory "
            "savers; gas; measured configs that could still beat the answer by more than the precision, not "
            "re-measured: none") in text
    assert ("could beat the answer by at most 12.2%: z2_gas1_tmbspg25_fp1 reads 417 samples/s ±2.1%; a measured config "
            "by at most +1.7% (z2_gas1_tmbspg29_fp1: 403.3-420.1 samples/s, 1 run(s)); an unmeasured one by at most "
            "+12.2% (z1_gas1_tmbspg30_fp1: 391.8-458.1 samples/s, 1 run(s) of its family, affine step time, under the "
            "compute roofline of a measured family)") in text


def make_job(tmp_path: Path, cpu: bool, max_launches: int) -> Job:
    """ZeRO stages 0 and 1, mbs 1..32 on 2 ranks of 8 GiB, at most ``max_launches`` launches."""
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": [0, 1]},
        "autotuning": {"enabled": True, "fast": True, "max_train_micro_batch_size_per_gpu": 32}}))
    return Job.build(str(tmp_path / "train.py"), ["--deepspeed_config", str(tmp_path / "ds.json")],
                     select_resources(local_slots=2),
                     TuneOptions(device_memory_bytes=8 * 2**30, results_dir=str(tmp_path / "r"), cpu=cpu,
                                 max_launches=max_launches))


def stopped(tmp_path: Path, cpu: bool, max_launches: int) -> StrategyResult:
    """A tuning of a known curve, tau(mbs) = 0.08 + 0.01 mbs s (100 mbs / (8 + mbs) samples/s), ZeRO-1 1% slower;
    each run's own interval 0, so every config reads within 2 x the 1% run-to-run noise: +-2%."""
    def evaluate(exps):
        for e in exps:
            e.status = Status.OK
            if e.kind is not ExperimentKind.PROFILE:
                e.metric, e.metric_rel_half_width = 100 * e.mbs / (8 + e.mbs) * (0.99 if e.stage == 1 else 1), 0.0
        return exps
    (tmp_path / f"{cpu}{max_launches}").mkdir()
    return Strategy(make_job(tmp_path / f"{cpu}{max_launches}", cpu, max_launches), evaluate).run()


def test_a_budget_stop_bounds_the_answer_from_the_intervals_and_the_throughput_model(tmp_path):
    # 2 launches on GPU ranks: the profile and ZeRO-0 mbs 32 (80 samples/s +-2%); mbs 16 is skipped (it cannot beat
    # 80 by more than the precision) and ZeRO-1's probe at 32 is cut. ZeRO-0 mbs 31, the largest not run, is bounded
    # by mbs 32's reading: 80 x 0.98 x 31 / 32 = 75.95 to 80 x 1.02 = 81.6, and 81.6 / (80 x 0.98) - 1 = +4.1%.
    # ZeRO-1 has no run and no family ran at two mbs (no roofline): not bounded, nor are the later phases.
    bound = stopped(tmp_path, False, 2).stop_bound
    assert bound is not None and (bound.answer, bound.value, bound.half_width) == ("z0_gas1_tmbspg32", 80.0,
                                                                                     pytest.approx(0.02))
    assert bound.measured == () and [(c.name, round(c.low, 2), round(c.high, 2), round(c.beats_by, 6))
                                     for c in bound.unmeasured] == [("z0_gas1_tmbspg31", 75.95, 81.6, 0.040816)]
    assert bound.beaten_by == pytest.approx(1.02 / 0.98 - 1)
    assert bound.undecided == ("ZeRO stage 0 mbs 1-31 not run (ran 32)", "ZeRO stage 1 mbs 1-32 not run",
                               "memory savers", "gas")
    assert bound.unbounded == ("z1_gas1_tmbspg32", "memory savers", "gas")
    # 3 launches: ZeRO-1's probe ran, 79.2 +-2%: it could beat the answer by -1% + sqrt(2%^2 + 2%^2) = +1.8%, within
    # the precision (no finalist unconfirmed); the stages are decided, the gas phase (no roofline) is not bounded
    bound = stopped(tmp_path, False, 3).stop_bound
    assert [(c.name, round(c.beats_by, 6)) for c in bound.measured] == [("z1_gas1_tmbspg32", 0.018284)]
    assert (bound.undecided, bound.unmeasured, bound.unbounded, bound.unconfirmed) == (("gas",), (),
                                                                                       ("z0_gas2_tmbspg32", "gas"), [])
    assert bound.describe()[1] == (
        "what ran or the throughput model bounds could beat the answer by at most 1.8%: z0_gas1_tmbspg32 reads 80 "
        "samples/s ±2.0%; a measured config by at most +1.8% (z1_gas1_tmbspg32: 77.62-80.78 samples/s, 1 run(s)); no "
        "unmeasured config is bounded (95% intervals and the throughput model; docs/decisions.md, D310)")
    # on CPU ranks mbs 16 runs (caches may favour it) and the model bounds no mbs below a family's runs (D104)
    bound = stopped(tmp_path, True, 3).stop_bound
    assert [(c.name, round(c.beats_by, 6)) for c in bound.measured] == [("z0_gas1_tmbspg16", round(
        (100 * 16 / 24) / 80 - 1 + math.hypot(0.02, 0.02), 6))]
    assert bound.unmeasured == () and bound.unbounded == ("ZeRO stage 0 mbs 1-15, 17-31", "ZeRO stage 1 mbs 1-32",
                                                          "memory savers", "gas")
    assert bound.describe()[2] == ("not bounded by the throughput model: ZeRO stage 0 mbs 1-15, 17-31; ZeRO stage 1 mbs "
                                   "1-32; memory savers; gas (on CPU ranks the model bounds only an mbs above its "
                                   "family's runs, D104)")


def test_under_a_budget_the_fine_pass_runs_after_the_gas_phase(tmp_path):
    # CPU ranks, ZeRO-0 only, 10 samples/s per unit of mbs (2% more at gas 2), out of memory above mbs 26: the mbs
    # search runs 32 (fails), 16, 24, 28 (fails), 26, 27 (fails); without a budget the fine pass then bisects below
    # the best at the memory boundary (25), and the gas phase runs gas 2 at 26
    def evaluate(exps):
        for e in exps:
            profile = e.kind is ExperimentKind.PROFILE
            e.status = Status.OOM if e.mbs > 26 and not profile else Status.OK
            if not profile and e.status is Status.OK:
                e.metric, e.metric_rel_half_width = 10.0 * e.mbs * (1.02 if e.gas == 2 else 1.0), 0.01
        return exps

    def tune(name, max_launches):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ds.json").write_text(json.dumps({
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
            "autotuning": {"enabled": True, "fast": True, "max_train_micro_batch_size_per_gpu": 32}}))
        job = Job.build(str(tmp_path / "train.py"), ["--deepspeed_config", str(tmp_path / name / "ds.json")],
                        select_resources(local_slots=2),
                        TuneOptions(device_memory_bytes=8 * 2**30, results_dir=str(tmp_path / name / "r"), cpu=True,
                                    max_launches=max_launches))
        result = Strategy(job, evaluate).run()
        return [(e.mbs, e.gas) for e in result.experiments if e.kind is not ExperimentKind.PROFILE], result

    search = [(32, 1), (16, 1), (24, 1), (28, 1), (26, 1), (27, 1)]
    ran, _ = tune("free", None)
    assert ran == search + [(25, 1), (26, 2)]
    # under --max-launches the fine pass, which refines within one stage, comes after the gas phase, which tries
    # another config: at 8 launches the gas phase is decided and the fine pass is what the stop leaves, its one gap
    ran, result = tune("eight", 8)
    assert ran == search + [(26, 2)] and result.stop_bound.undecided == ("ZeRO stage 0 mbs 25 not run (ran 16, 24, 26)",)
    assert "not decided: the fine pass, the answer's re-measurement, the longest batch" in result.stopped
    ran, result = tune("nine", 9)
    assert ran == search + [(26, 2), (25, 1)] and not result.stopped


@pytest.mark.e2e
@pytest.mark.usefixtures("one_thread_per_rank")
def test_a_real_tuning_stops_at_max_launches_with_an_answer_deepspeed_accepts(tmp_path):
    ds = write_config(tmp_path / "ds.json")
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "3GiB",
                           "--results-dir", str(tmp_path / "r"), "--timeout", "300", "--max-launches", "2", SCRIPT,
                           *TINY, "--steps", "4", "--deepspeed_config", str(ds)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = sorted(p.parent.name for p in (tmp_path / "r" / "exps").glob("*/exp.json"))
    assert len(launched) == 2 and launched[0].startswith("profile"), launched  # the profile and one run
    summary = " ".join((tmp_path / "r" / "summary.txt").read_text().split())
    assert "stopped early: the launch budget is spent (2 of --max-launches 2 launches" in summary
    assert (tmp_path / "r" / "ds_config_optimal.json").exists() and (tmp_path / "r" / "cmd_optimal.txt").exists()


def test_the_options_refuse_a_budget_that_holds_nothing(tmp_path):
    for option, value in (("--max-launches", "0"), ("--max-launches", "2.5"), ("--max-device-hours", "0"),
                          ("--max-device-hours", "inf"), ("--max-device-hours", "-1")):
        proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "3GiB",
                               option, value, SCRIPT, "--deepspeed_config", "ds.json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and option in proc.stderr and repr(value) in proc.stderr, (option, proc.stderr)
    assert not any(tmp_path.iterdir())  # nothing written
