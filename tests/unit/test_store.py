"""Tests for zerotune.run.store: exp.json written and read back only when it verifies, the directory locks.

The hostile cases (foreign, edited and corrupt records, symlinks, a user's directory where an experiment's goes)
are in tests/hostile/test_hostile_records.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.core.errors import ConfigError, RecordError
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.run import exprecord, store
from zerotune.run.backends.timeout import profile_wall_s

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def ok_run(name: str = "z1_mbs2_gas1", kind: ExperimentKind = ExperimentKind.MBS) -> Experiment:
    return Experiment(name, json.loads(json.dumps(CONFIG)), num_slots=2, kind=kind, status=Status.OK, metric=0.25,
                      metrics={"latency": 250000}, exit_code=0, wall_s=12.5)


# --- exp.json ---------------------------------------------------------------------------------------------------------

def test_record_round_trips_and_is_matched_on_the_config_digest(tmp_path):
    e = ok_run()
    exprecord.write_record(e, tmp_path)
    data = json.loads((tmp_path / "exp.json").read_text())
    assert data["config_digest"] == exprecord.config_digest(CONFIG) and len(data["config_digest"]) == 12
    assert list(data)[-6:] == ["config_digest", "resume_key", "resume_context", "recorded_at", "record_version",
                               "record_digest"]

    assert exprecord.load_record(tmp_path, CONFIG) == e
    # the same content spelled differently is the same config; another config is not
    assert exprecord.load_record(tmp_path, {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2}) == e
    assert exprecord.load_record(tmp_path, {**CONFIG, "train_micro_batch_size_per_gpu": 4}) is None
    assert exprecord.load_record(tmp_path / "nowhere", CONFIG) is None


def test_a_record_is_matched_on_its_resume_key(tmp_path):
    exprecord.write_record(ok_run(), tmp_path, key="k1", context={"script_sha256": "ab"})
    record = exprecord.ExpRecord.from_dict(json.loads((tmp_path / "exp.json").read_text()))
    assert (record.resume_key, record.resume_context, record.experiment) == ("k1", {"script_sha256": "ab"}, ok_run())
    assert exprecord.load_record(tmp_path, CONFIG, "k1") == ok_run()
    assert exprecord.load_record(tmp_path, CONFIG, "k2") is None


def test_the_longest_sequence_seen_round_trips_and_a_record_written_before_it_still_verifies(tmp_path):
    e = ok_run()
    e.max_seq_len_seen = 512
    exprecord.write_record(e, tmp_path)
    assert exprecord.load_record(tmp_path, CONFIG) == e
    data = exprecord.ExpRecord(ok_run(), "", {}, "2026-01-02T03:04:05").to_dict()
    del data["max_seq_len_seen"]  # as an exp.json written before the field was
    data["record_digest"] = exprecord.record_digest(data)
    assert exprecord.ExpRecord.from_dict(data).experiment == ok_run()


def test_an_interrupted_record_is_not_loaded(tmp_path):
    e = ok_run()
    e.status = Status.INTERRUPTED
    exprecord.write_record(e, tmp_path)
    assert exprecord.load_record(tmp_path, CONFIG) is None


@pytest.mark.parametrize("field, value, why", [
    ("name", 7, "'name' is not a JSON string"),
    ("metrics", [], "'metrics' is not a JSON object"),
    ("resume_context", None, "'resume_context' is not a JSON object"),
    ("status", "done", "'status' 'done' is not an experiment's status"),
    ("kind", "warmup", "'kind' 'warmup' is not an experiment's kind"),
    ("metric", "fast", "'metric' 'fast' is not a number"),
])
def test_a_field_not_as_zerotune_writes_it_is_named(field, value, why):
    data = exprecord.ExpRecord(ok_run(), "k", {}, "2026-01-02T03:04:05").to_dict()
    data[field] = value
    data["record_digest"] = exprecord.record_digest(data)  # the digest redone: only the field is wrong
    with pytest.raises(RecordError, match=f"^its fields are not an experiment's: {why}$"):
        exprecord.ExpRecord.from_dict(data)


def test_load_records_keeps_the_verified_records_of_their_own_directories(tmp_path):
    for name in ("b", "a", "copied", "edited"):
        (tmp_path / name).mkdir()
        exprecord.write_record(ok_run("b" if name == "copied" else name), tmp_path / name)
    edited = json.loads((tmp_path / "edited" / "exp.json").read_text())
    (tmp_path / "edited" / "exp.json").write_text(json.dumps({**edited, "metric": 9.0}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "exp.json").write_text("not json")
    assert [r.experiment.name for r in exprecord.load_records(tmp_path)] == ["a", "b"]
    assert exprecord.load_records(tmp_path / "nowhere") == []


def test_the_default_timeout_reads_the_profile_run_from_a_record_that_verifies(tmp_path):
    assert profile_wall_s(tmp_path) is None
    for name, wall_s in (("profile", 30.0), ("profile_r2", 40.0)):
        (tmp_path / name).mkdir()
        profile = ok_run(name, ExperimentKind.PROFILE)
        profile.wall_s = wall_s
        exprecord.write_record(profile, tmp_path / name)
    edited = json.loads((tmp_path / "profile_r2" / "exp.json").read_text())
    (tmp_path / "profile_r2" / "exp.json").write_text(json.dumps({**edited, "wall_s": 400.0}))
    assert profile_wall_s(tmp_path) == 30.0


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
