"""Tests for zerotune.run.store: exp.json written and read back only when it verifies, the directory locks.

The hostile cases (foreign, edited and corrupt records, symlinks, a user's directory where an experiment's goes)
are in tests/test_hostile_records.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.run import store

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def ok_run(name: str = "z1_mbs2_gas1", kind: ExperimentKind = ExperimentKind.MBS) -> Experiment:
    return Experiment(name, json.loads(json.dumps(CONFIG)), num_slots=2, kind=kind, status=Status.OK, metric=0.25,
                      metrics={"latency": 250000}, exit_code=0, wall_s=12.5)


# --- exp.json ---------------------------------------------------------------------------------------------------------

def test_record_round_trips_and_is_matched_on_the_config_digest(tmp_path):
    e = ok_run()
    store.write_record(e, tmp_path)
    data = json.loads((tmp_path / "exp.json").read_text())
    assert data["config_digest"] == store.config_digest(CONFIG) and len(data["config_digest"]) == 12

    assert store.load_record(tmp_path, CONFIG) == e
    # the same content spelled differently is the same config; another config is not
    assert store.load_record(tmp_path, {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2}) == e
    assert store.load_record(tmp_path, {**CONFIG, "train_micro_batch_size_per_gpu": 4}) is None
    assert store.load_record(tmp_path / "nowhere", CONFIG) is None


def test_an_interrupted_record_is_not_loaded(tmp_path):
    e = ok_run()
    e.status = Status.INTERRUPTED
    store.write_record(e, tmp_path)
    assert store.load_record(tmp_path, CONFIG) is None


# --- the locks ------------------------------------------------------------------------------------------------------

def test_lock_refuses_a_second_tuner_naming_the_holders_pid(tmp_path):
    with store.ResultsLock(tmp_path / "results"):
        with pytest.raises(ConfigError, match=rf"in use by another zerotune \(pid {os.getpid()}\)"):
            with store.ResultsLock(tmp_path / "results"):
                pass
    with store.ResultsLock(tmp_path / "results"):  # released on exit
        pass


def test_lock_of_a_killed_tuner_is_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from zerotune.run.store import ResultsLock\n"
                               "with ResultsLock(sys.argv[1]):\n"
                               "    print('locked', flush=True)\n"
                               "    time.sleep(600)\n", str(tmp_path / "results")],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=rf"\(pid {holder.pid}\)"):
            with store.ResultsLock(tmp_path / "results"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with store.ResultsLock(tmp_path / "results"):  # the kernel dropped the dead holder's flock
        pass
