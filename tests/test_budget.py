"""The launch budget (--max-launches, --max-device-hours): the tuning launches no more, answers with the best of
what ran and says what it did not decide (zerotune/strategy/budget.py)."""
import subprocess
import sys

import pytest

from tests.helpers.simulated import tune_simulated
from tests.helpers.tiny import SCRIPT, TINY, write_config
from zerotune.core.experiment import Experiment, Status
from zerotune.strategy.budget import LaunchBudget


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
    assert "not decided: ZeRO stages and mbs, memory savers, gas, the answer's re-measurement" in text
    # without a budget the summary sets what the tuning planned once the profile ran (the dry run's plan on the
    # profiled memory model, 4 launches at the profile's 290 device-seconds each) against what it spent
    full_text = " ".join((tmp_path / "full" / "r" / "summary.txt").read_text().split())
    assert ("cost plan: 4 launch(es), 0.322 device-hours planned once the profile ran (the strategy on its memory "
            "model, each launch at the profile's device-seconds); spent 9 launch(es) (0 re-measurement(s)), 0.806 "
            "device-hours") in full_text


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
