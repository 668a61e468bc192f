"""Hostile records and results (issue 28, round two): nothing lost, no traceback, no silent wrong answer.

zerotune removes or writes only what it can prove is its own (an experiment directory whose ``exp.json``
is a record it wrote for that directory, identified by its content, never by the file's name), and
never through a symlink; one tuner per experiments dir; a record that does not verify (its digest,
schema or version) is re-run, neither trusted nor fatal; the results are written atomically, and a
stop signal while they are written leaves the old answer or the new one, whole.

Each scenario (:func:`~benchmarks.faults.hostile_records.matrix_cases`) runs the real CLI with the stand-in launcher
in a fresh directory and returns what went wrong; the tests assert that nothing did, and
``benchmarks/fault_matrix.py`` prints the same scenarios as rows. The unit tests below them pin each rule on the
function that holds it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.faults.hostile_records import USER_RECORD, foreign_record, matrix_cases, user_dir
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.run import exprecord, store
from zerotune.run.backends.base import Backend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool
from zerotune.run.store import (
    ExpsLock,
    clear_experiments,
    experiment_dir,
    tuning_locks,
    write_json_atomic,
    write_text_atomic,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


# --- the scenarios: the real CLI in a fresh directory -------------------------------------------------

@pytest.mark.e2e  # real tuner processes: 10 to 40 s each
@pytest.mark.parametrize("case", matrix_cases(), ids=[c[1] for c in matrix_cases()])
def test_a_hostile_record_scenario_loses_nothing(tmp_path, case):
    _, _, run = case
    assert run(tmp_path) == {"why": [], "lost": 0, "left": 0, "tracebacks": 0}


# --- the rules, each on the function that holds it -----------------------------------------------------

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def record_in(exps: Path, name: str, status: Status = Status.OK, metric: float | None = 10.0) -> Path:
    """zerotune's own experiment directory ``exps/name`` with its record (no resume context)."""
    exp = Experiment(name, dict(CONFIG), status=status, metric=metric)
    (exps / name).mkdir(parents=True)
    exprecord.write_record(exp, exps / name)
    return exps / name / "exp.json"


def test_overwrite_removes_zerotunes_records_and_keeps_every_other_exp_json(tmp_path):
    exps = tmp_path / "shared"
    record_in(exps, "z1_gas1_tmbspg2")
    mine = {**user_dir(exps / "my_run"), **user_dir(exps / "z0_gas1_tmbspg1")}  # the second under an experiment's name
    copied = exps / "z1_gas1_tmbspg4"  # zerotune's record of another experiment, copied by hand
    copied.mkdir()
    (copied / "exp.json").write_bytes((exps / "z1_gas1_tmbspg2" / "exp.json").read_bytes())
    (exps / "deepspeed_run").mkdir()
    (exps / "deepspeed_run" / "exp.json").write_text(json.dumps({**foreign_record(), "name": "deepspeed_run"}))
    (exps / "linked").symlink_to("z1_gas1_tmbspg2")
    assert clear_experiments(exps) == ["z1_gas1_tmbspg2"]
    assert all(p.read_bytes() == data for p, data in mine.items())
    assert sorted(p.name for p in exps.iterdir()) == ["deepspeed_run", "linked", "my_run", "z0_gas1_tmbspg1",
                                                      "z1_gas1_tmbspg4"]


def test_not_own_says_why_a_directory_is_not_zerotunes(tmp_path):
    path = record_in(tmp_path, "z1_gas1_tmbspg2")
    assert store.not_own(path.parent) == ""
    record = json.loads(path.read_text())
    for content, why in ((b"\x00\xff garbage {", "its exp.json is cannot be read"),
                         (b"[" * 100_000, "its exp.json is not JSON"),
                         (json.dumps(USER_RECORD).encode(), "is not a zerotune record of experiment 'z1_gas1_tmbspg2'"),
                         (json.dumps({**record, "name": "z0"}).encode(), "not a zerotune record"),
                         (json.dumps({**record, "config_digest": 7}).encode(), "not a zerotune record")):
        path.write_bytes(content)
        assert why in store.not_own(path.parent), content[:40]
    path.unlink()
    assert store.not_own(path.parent) == "no exp.json"
    assert store.not_own(tmp_path / "nowhere") == "not a directory"


def test_a_record_that_does_not_verify_is_not_trusted_and_not_fatal(tmp_path, caplog):
    path = record_in(tmp_path, "z1_gas1_tmbspg2")
    assert exprecord.load_record(path.parent, CONFIG).metric == 10.0
    record = json.loads(path.read_text())
    edited_config = {**record, "ds_config": {**CONFIG, "gradient_clipping": 7.0}}  # never ran; digests kept
    redigested = {**edited_config, "record_digest": exprecord.record_digest(edited_config)}
    bad_status = {**record, "status": "done"}
    cases = {
        "edited ds_config": (edited_config, "does not match its record_digest"),
        "edited ds_config, record digest redone": (redigested, "its ds_config does not match its config_digest"),
        "edited metric": ({**record, "metric": 1e9}, "does not match its record_digest"),
        "unknown status": (bad_status, "does not match its record_digest"),
        "unknown status, record digest redone": ({**bad_status, "record_digest": exprecord.record_digest(bad_status)},
                                                 "its fields are not an experiment's"),
        "an older zerotune's": ({k: v for k, v in record.items() if k not in ("record_version", "record_digest")},
                                "record version None, not this zerotune's 1"),
        "another version": ({**record, "record_version": 2}, "record version 2"),
        "foreign": (foreign_record(), "record version None"),
    }
    for case, (data, why) in cases.items():
        path.write_text(json.dumps(data))
        caplog.clear()
        assert exprecord.load_record(path.parent, CONFIG) is None, case
        assert why in caplog.text, (case, caplog.text)
    for content in (b"\x00\xff garbage {", b"[" * 100_000, b'{"status": "ok"'):
        path.write_bytes(content)
        assert exprecord.load_record(path.parent, CONFIG) is None


def test_a_record_round_trips_with_its_version_and_digest(tmp_path):
    path = record_in(tmp_path, "z1_gas1_tmbspg2", metric=float("nan"))
    record = json.loads(path.read_text())
    assert record["record_version"] == exprecord.RECORD_VERSION == 1
    assert record["record_digest"] == exprecord.record_digest(record) and len(record["record_digest"]) == 64
    assert exprecord.ExpRecord.from_dict(record).to_dict()["record_digest"] == record["record_digest"]  # it verifies


class Recorder(Backend):
    """Runs nothing: each experiment is OK at 1.0 samples/s, and says which directory it got."""

    def run(self, exp, reservation, exp_dir):
        exp.status, exp.metric, exp.error = Status.OK, 1.0, str(exp_dir)
        return exp

    def cancel_all(self) -> None:
        pass


def test_a_run_never_removes_a_directory_it_cannot_prove_its_own(tmp_path, caplog):
    exps = tmp_path / "exps"
    mine = user_dir(exps / "z0_gas1_tmbspg1")  # a user's directory under an experiment's name
    garbled = record_in(exps, "z0_gas1_tmbspg2")
    garbled.write_bytes(b"\x00 garbage")
    old = record_in(exps, "z0_gas1_tmbspg4", status=Status.INTERRUPTED)  # zerotune's own: removed for the rerun
    (exps / "z0_gas1_tmbspg8").mkdir()  # made just before a SIGKILL
    scheduler = Scheduler(Recorder(), SlotPool(select_resources(local_slots=1)), exps)
    names = ["z0_gas1_tmbspg1", "z0_gas1_tmbspg2", "z0_gas1_tmbspg4", "z0_gas1_tmbspg8"]
    done = scheduler.run([Experiment(n, dict(CONFIG)) for n in names])
    assert [(e.status, e.error) for e in done] == [(Status.OK, str(exps / n)) for n in names]
    assert {p.name: data for p, data in mine.items()} == {
        p.name: p.read_bytes() for p in (exps / "z0_gas1_tmbspg1.kept-1").iterdir()}
    assert (exps / "z0_gas1_tmbspg2.kept-1" / "exp.json").read_bytes() == b"\x00 garbage"
    assert not (exps / "z0_gas1_tmbspg4.kept-1").exists() and json.loads(old.read_text())["status"] == "ok"
    assert not (exps / "z0_gas1_tmbspg8.kept-1").exists()
    assert f"{exps / 'z0_gas1_tmbspg1'}: its exp.json is not a zerotune record of experiment 'z0_gas1_tmbspg1', so " \
           f"it is not zerotune's: moved to z0_gas1_tmbspg1.kept-1, whole" in caplog.text


def test_a_symlink_inside_the_exps_dir_is_refused_and_its_target_kept(tmp_path):
    exps = tmp_path / "exps"
    mine = user_dir(exps / "userdata")
    (exps / "z0_gas1_tmbspg1").symlink_to("userdata")
    with pytest.raises(ConfigError, match=r"z0_gas1_tmbspg1 is a symlink \(to userdata\): zerotune never writes"):
        experiment_dir(exps, "z0_gas1_tmbspg1")
    scheduler = Scheduler(Recorder(), SlotPool(select_resources(local_slots=1)), exps)
    with pytest.raises(ConfigError, match="is a symlink"):
        scheduler.run([Experiment("z0_gas1_tmbspg2", dict(CONFIG)), Experiment("z0_gas1_tmbspg1", dict(CONFIG))])
    assert clear_experiments(exps) == []
    assert {p: p.read_bytes() for p in (exps / "userdata").iterdir()} == mine
    assert not (exps / "z0_gas1_tmbspg2").exists()  # the batch was refused whole


def test_the_exps_dir_is_locked_as_the_results_dir_is(tmp_path):
    with tuning_locks(tmp_path / "first", tmp_path / "autotuning_exps"):
        with pytest.raises(ConfigError, match=rf"exps dir {tmp_path / 'autotuning_exps'} is in use by another "
                                              rf"zerotune \(pid {os.getpid()}\); wait for it or give each tuning"):
            with tuning_locks(tmp_path / "second", tmp_path / "autotuning_exps"):
                pass
    with tuning_locks(tmp_path / "same", tmp_path / "same"):  # one directory for both: one lock
        pass
    with ExpsLock(tmp_path / "autotuning_exps"):  # released on exit
        pass


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    (tmp_path / "exps").mkdir()
    (tmp_path / "exps" / ".zerotune.lock").symlink_to(tmp_path / "precious.txt")
    with pytest.raises(ConfigError, match="cannot create it or its lock file"):
        with ExpsLock(tmp_path / "exps"):
            pass
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_a_log_at_a_symlink_is_written_in_its_place_and_the_target_kept(tmp_path):
    from zerotune.run.warm.client import WarmServer
    (tmp_path / "precious.txt").write_text("keep me")
    exps = tmp_path / "exps"
    exps.mkdir()
    (exps / ".zerotune-warm.log").symlink_to(tmp_path / "precious.txt")  # the warm server's log
    server = WarmServer("train.py", {}, exps / ".running")
    assert server.log_path == exps / ".zerotune-warm.log"
    for append in (True, False):
        with store.open_log(server.log_path, append=append) as log:
            log.write(b"server line\n")
        assert not server.log_path.is_symlink() and server.log_path.read_bytes() == b"server line\n"
        server.log_path.unlink()
        server.log_path.symlink_to(tmp_path / "precious.txt")
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    server.stop()


def test_an_atomic_write_stopped_midway_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    write_text_atomic(tmp_path / "summary.txt", "old\n")

    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)
    for write, data in ((write_text_atomic, "new\n"), (write_json_atomic, {"new": 1})):
        with pytest.raises(KeyboardInterrupt):
            write(tmp_path / "summary.txt", data)
        assert (tmp_path / "summary.txt").read_text() == "old\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]
    monkeypatch.undo()
    (tmp_path / "elsewhere.txt").write_text("keep me")
    (tmp_path / "linked.txt").symlink_to(tmp_path / "elsewhere.txt")
    write_text_atomic(tmp_path / "linked.txt", "new\n")  # replaces the link, never writes through it
    assert (tmp_path / "elsewhere.txt").read_text() == "keep me" and not (tmp_path / "linked.txt").is_symlink()


def test_a_running_record_round_trips_and_a_damaged_one_names_nothing_it_cannot(tmp_path):
    from zerotune.run.processes import RunningRecord, write_running_record

    path = write_running_record(tmp_path, "z1_gas1_tmbspg4", "tok", 29500, leader=4242, since=1700000000.5)
    record = RunningRecord.from_dict(json.loads(path.read_text()), path.stem)
    assert (record.name, record.token, record.master_port, record.tuner_pid, record.leader, record.since,
            record.stop) == ("z1_gas1_tmbspg4", "tok", 29500, os.getpid(), 4242, 1700000000.5, None)
    assert record.to_dict() == json.loads(path.read_text())
    damaged = RunningRecord.from_dict({"token": 7, "master_port": True, "tuner_pid": "1", "leader": 1.5,
                                       "since": "now", "host": ["h"]}, "z2")
    assert damaged == RunningRecord("z2")  # a bool is not a port, a string not a pid: none is used
