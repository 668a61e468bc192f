"""Hostile records and results (issue 28, round two): nothing lost, no traceback, no silent wrong answer.

zerotune removes or writes only what it can prove is its own (an experiment directory whose ``exp.json``
is a record it wrote for that directory, identified by its content, never by the file's name), and
never through a symlink; one tuner per experiments dir; a record that does not verify (its digest,
schema or version) is re-run, neither trusted nor fatal; the results are written atomically, and a
stop signal while they are written leaves the old answer or the new one, whole.

Each scenario (:func:`matrix_cases`) runs the real CLI with the stand-in launcher of
``tests/test_faults.py`` in a fresh directory and returns what went wrong; the tests assert that
nothing did, and ``benchmarks/fault_matrix.py`` prints the same scenarios as rows. The unit tests
below them pin each rule on the function that holds it.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.test_faults import BASE_CONFIG, DRIVER, LAUNCHER, RANK, run_tuner, stand_in_processes
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status, write_json_atomic, write_text_atomic
from zerotune.run import expdir
from zerotune.run.backends.base import Backend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import ExpsLock, Scheduler, clear_experiments, experiment_dir, tuning_locks
from zerotune.run.slots import SlotPool


KIND = "round two: records"

# The tuner with the stand-in launcher; with $STANDIN_SIGNAL_AT set it sends itself that signal right
# after ds_config_optimal.json is renamed into place: a stop signal in the middle of writing the results.
HOOKED_DRIVER = r'''
import os
import signal
if os.environ.get("STANDIN_SIGNAL_AT"):
    _replace = os.replace

    def replace(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        if str(dst).endswith("ds_config_optimal.json") and os.environ.pop("STANDIN_SIGNAL_AT", None):
            os.kill(os.getpid(), signal.SIGTERM)
    os.replace = replace
''' + DRIVER

CHECKPOINT = b"\x89weights of epoch 3\x00" * 64  # a user's file beside a file of theirs named exp.json
USER_RECORD = {"epoch": 3, "lr": 1e-4, "note": "my training run, not zerotune's"}


# --- the scenarios: the real CLI in a fresh directory -------------------------------------------------


def make_work(root: Path, name: str, **autotuning) -> Path:
    """A fresh directory under ``root`` with the stand-ins and ``ds.json`` (BASE_CONFIG, ``autotuning`` merged)."""
    work = root / name
    work.mkdir(parents=True)
    for file, text in (("rank.py", RANK), ("launcher.py", LAUNCHER), ("driver.py", HOOKED_DRIVER)):
        (work / file).write_text(text)
    write_config(work, "ds.json", **autotuning)
    return work


def write_config(work: Path, name: str, **autotuning) -> Path:
    config = json.loads(json.dumps(BASE_CONFIG))
    config["autotuning"].update(autotuning)
    (work / name).write_text(json.dumps(config))
    return work / name


def argv(work: Path, *extra: str, config: str = "ds.json") -> list[str]:
    """``zerotune tune`` without ``--results-dir``: the config's ``results_dir`` and ``exps_dir`` hold. Cold: a warm
    rank carries the torch its server imported (about 200 MiB of VmData), which these stand-ins, written against a
    2 GiB budget that only a torch-free rank leaves room in beside ZeRO-1's 2 GB buffer, never import."""
    return ["tune", "--num_gpus", "1", "--device-memory", "2GiB", "--timeout", "30", "--cold-launch", *extra,
            str(work / "rank.py"), "--deepspeed_config", str(work / config)]


class Report:
    """What a scenario saw: the fault matrix's row (``why`` empty when it was survived)."""

    def __init__(self, work: Path):
        self.work, self.why, self.lost, self.tracebacks = work, [], 0, 0

    def run(self, args: list[str], expect: int, says: str = "", plan: dict | None = None, **env) -> str:
        code, _, err = run_tuner(self.work, args, plan, timeout=180, **env)
        self.saw(code, err, expect, says)
        return err

    def saw(self, code: int, err: str, expect: int, says: str = "") -> None:
        self.tracebacks += err.count("Traceback")
        if code != expect:
            self.why.append(f"exit {code}, expected {expect}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
        if says and says not in err:
            self.why.append(f"stderr does not say {says!r}")

    def check(self, ok: bool, why: str) -> None:
        if not ok:
            self.why.append(why)

    def kept(self, before: dict[Path, bytes], what: str) -> None:
        """Each file of ``before`` still there with the same bytes, else counted lost."""
        gone = [p for p, data in before.items() if not p.is_file() or p.read_bytes() != data]
        self.lost += len(gone)
        if gone:
            self.why.append(f"{what} lost or changed: {sorted(str(p.relative_to(self.work)) for p in gone)}")

    def outcome(self) -> dict:
        left = stand_in_processes(self.work)
        if left:
            self.why.append(f"{len(left)} process(es) left")
        if self.tracebacks:
            self.why.append(f"{self.tracebacks} traceback(s)")
        return {"why": self.why, "lost": self.lost, "left": len(left), "tracebacks": self.tracebacks}


def user_dir(path: Path) -> dict[Path, bytes]:
    """A user's directory holding a file named exp.json (not zerotune's) and a checkpoint; its files' bytes."""
    path.mkdir(parents=True)
    (path / "exp.json").write_text(json.dumps({**USER_RECORD, "run": path.name}))
    (path / "checkpoint.pt").write_bytes(CHECKPOINT)
    return {p: p.read_bytes() for p in path.iterdir()}


def finished(exps: Path) -> dict[Path, bytes]:
    """The finished (ok or oom) records under ``exps``, by path."""
    return {p: p.read_bytes() for p in exps.glob("*/exp.json")
            if (expdir.read_json(p) or {}).get("status") in ("ok", "oom")}


def recorded(exps: Path) -> dict[str, dict]:
    """Each experiment directory's exp.json content, by name ({} where it is not a JSON object)."""
    return {p.parent.name: expdir.read_json(p) or {} for p in exps.glob("*/exp.json")}


def optimal(results: Path) -> tuple[int, int] | None:
    """(stage, mbs) of ds_config_optimal.json; None without one."""
    cfg = expdir.read_json(results / "ds_config_optimal.json")
    return None if cfg is None else (cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"])


def overwrite_beside_a_users_exp_json(root: Path) -> dict:
    """Item 1: ``autotuning.exps_dir`` names a directory the user also keeps runs in (each with a file named
    ``exp.json`` beside a checkpoint), one of them under an experiment's name: neither a run nor ``--overwrite``
    removes a file of theirs, and ``--overwrite`` still runs every experiment again."""
    work = make_work(root, "overwrite", results_dir="results", exps_dir="shared")
    report = Report(work)
    mine = user_dir(work / "shared" / "my_run")
    named = {p.name: data for p, data in user_dir(work / "shared" / "z0_gas1_tmbspg1").items()}
    report.run(argv(work), 0)
    report.run(argv(work, "--overwrite"), 0)
    report.kept(mine, "the user's files")
    whole = [d for d in (work / "shared").iterdir() if d.is_dir() and not d.is_symlink()
             and {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == named]
    report.check(len(whole) == 1, "the user's directory under an experiment's name is lost")
    report.lost += len(whole) != 1
    summary = work / "results" / "summary.txt"
    launched = re.search(r"(\d+) experiments \((\d+) launched now\)", summary.read_text() if summary.is_file() else "")
    report.check(launched is not None and launched.group(1) == launched.group(2),
                 f"--overwrite did not run every experiment again: {launched and launched.group(0)}")
    report.check(optimal(work / "results") == (0, 2), f"answer {optimal(work / 'results')}, expected (0, 2)")
    return report.outcome()


def two_tuners_on_one_exps_dir(root: Path) -> dict:
    """Item 2: two configs that differ only in ``results_dir``, started from one working directory, share the
    default ``autotuning_exps``: the second is refused (exit 2) while the first runs, whose records stay its own."""
    work = make_work(root, "two_tuners", results_dir="first")
    write_config(work, "second.json", results_dir="second")
    exps = work / "autotuning_exps"
    report = Report(work)
    first: list[tuple[int, str, str]] = []
    tuner = threading.Thread(target=lambda: first.append(run_tuner(work, argv(work), {"z": "slow"}, timeout=180,
                                                                   STANDIN_SLOW_S="3")))
    tuner.start()
    deadline = time.monotonic() + 120
    while not finished(exps) and tuner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    before = finished(exps)
    report.run(argv(work, config="second.json"), 2, f"exps dir {exps} is in use by another zerotune (pid",
               plan={"z": "slow"}, STANDIN_SLOW_S="3")
    tuner.join()
    report.saw(first[0][0], first[0][2], 0)
    report.kept(before, "the first tuner's finished records")
    report.check(optimal(work / "first") == (0, 2), f"the first's answer {optimal(work / 'first')}, expected (0, 2)")
    report.check(not (work / "second" / "ds_config_optimal.json").exists(), "the second tuner wrote an answer")
    return report.outcome()


def symlink_in_the_exps_dir(root: Path) -> dict:
    """Item 7: a symlink where an experiment's directory goes, to a user's directory inside the exps dir:
    refused (exit 2, naming it) before anything is written through it, and ``--overwrite`` keeps its target."""
    work = make_work(root, "symlink", results_dir="results", exps_dir="results/exps")
    exps = work / "results" / "exps"
    mine = user_dir(exps / "userdata")
    (exps / "z0_gas1_tmbspg1").symlink_to("userdata")
    report = Report(work)
    report.run(argv(work), 2, "z0_gas1_tmbspg1 is a symlink (to userdata)")
    report.run(argv(work, "--overwrite"), 2, "z0_gas1_tmbspg1 is a symlink (to userdata)")
    report.kept(mine, "the symlink's target")
    written = sorted(p.name for p in (exps / "userdata").glob("*"))
    report.check(written in ([], ["checkpoint.pt", "exp.json"]), f"written into the symlink's target: {written}")
    return report.outcome()


def foreign_record() -> dict:
    """An ``exp.json`` as DeepSpeed's own autotuner writes it (its experiments are named as zerotune's are)."""
    return {"name": "z1_gas1_tmbspg2", "ds_config": {"train_micro_batch_size_per_gpu": 2}, "num_gpus": 1,
            "num_nodes": 1, "result_dir": "autotuning_results/z1_gas1_tmbspg2"}


def corrupt_or_foreign_records(root: Path) -> dict:
    """Item 10: resume over a corrupt ``exp.json``, a foreign one (DeepSpeed's autotuner's) and one with a
    status no zerotune writes: each experiment runs again, without a traceback; the corrupt and foreign files
    are kept (moved aside), the intact records are reused unchanged, the answer is the undisturbed one."""
    work = make_work(root, "corrupt", results_dir="results", exps_dir="results/exps")
    exps = work / "results" / "exps"
    report = Report(work)
    report.run(argv(work), 0)
    hostile = {"z0_gas1_tmbspg1": b"\x00\xff\xfe garbage {", "z1_gas1_tmbspg2": json.dumps(foreign_record()).encode()}
    winner = exps / "z0_gas1_tmbspg2" / "exp.json"
    intact = {p: data for p, data in finished(exps).items() if p.parent.name not in {*hostile, winner.parent.name}}
    for name, data in hostile.items():
        (exps / name / "exp.json").write_bytes(data)
    record = json.loads(winner.read_text())
    winner.write_text(json.dumps({**record, "status": "done"}))  # a status this zerotune never writes
    report.run(argv(work), 0)
    report.kept(intact, "intact records")
    now = recorded(exps)
    rerun = {name: now.get(name, {}).get("status") for name in (*hostile, winner.parent.name)}
    report.check(set(rerun.values()) == {"ok"}, f"not run again: {rerun}")
    for name, data in hostile.items():
        report.check(any(p.read_bytes() == data for p in exps.glob(f"{name}*/exp.json") if p.parent.name != name),
                     f"{name}'s exp.json (not zerotune's) was not kept")
    report.check(optimal(work / "results") == (0, 2), f"answer {optimal(work / 'results')}, expected (0, 2)")
    return report.outcome()


def edited_records(root: Path) -> dict:
    """Item 10: resume over records edited by hand with their digests kept: a ``ds_config`` that never ran
    and a metric never measured are not trusted (both experiments run again), so neither becomes the answer."""
    work = make_work(root, "edited", results_dir="results", exps_dir="results/exps")
    exps = work / "results" / "exps"
    report = Report(work)
    report.run(argv(work), 0)
    edits = {"z0_gas1_tmbspg2": lambda r: r["ds_config"].update(gradient_clipping=7.0),
             "z1_gas1_tmbspg2": lambda r: r.update(metric=1e9)}
    intact = {p: data for p, data in finished(exps).items() if p.parent.name not in edits}
    for name, edit in edits.items():
        record = json.loads((exps / name / "exp.json").read_text())
        edit(record)
        (exps / name / "exp.json").write_text(json.dumps(record, indent=2))
    report.run(argv(work), 0)
    report.kept(intact, "intact records")
    now = recorded(exps)
    report.check("gradient_clipping" not in now["z0_gas1_tmbspg2"].get("ds_config", {}),
                 "the edited ds_config was trusted")
    report.check(now["z1_gas1_tmbspg2"].get("metric") != 1e9, "the edited metric was trusted")
    answer = expdir.read_json(work / "results" / "ds_config_optimal.json") or {}
    report.check("gradient_clipping" not in answer, "a config that never ran is ds_config_optimal.json")
    report.check(optimal(work / "results") == (0, 2), f"answer {optimal(work / 'results')}, expected (0, 2)")
    return report.outcome()


def signal_while_results_are_written(root: Path) -> dict:
    """Item 11: SIGTERM right after ds_config_optimal.json is renamed into place, while the next files are
    written: the results dir holds the old answer or the new one, whole (the config, summary.txt and
    cmd_optimal.txt agree, no temp file), and the tuner says it was interrupted."""
    work = make_work(root, "signal", results_dir="results", exps_dir="results/exps")
    results = work / "results"
    report = Report(work)
    report.run(argv(work), 0)  # the old answer: mbs 2
    write_config(work, "ds.json", results_dir="results", exps_dir="results/exps",
                 max_train_micro_batch_size_per_gpu=4)  # the new one: mbs 4
    report.run(argv(work), 143, "zerotune: interrupted (SIGTERM); finished results are kept", STANDIN_SIGNAL_AT="1")
    config = optimal(results)
    said = re.search(r"Optimal: \S+ \(ZeRO stage (\d+), mbs (\d+)", (results / "summary.txt").read_text())
    report.check(config in ((0, 2), (0, 4)), f"ds_config_optimal.json: {config}")
    report.check(said is not None and (int(said[1]), int(said[2])) == config,
                 f"summary.txt says {said and said.group(0)}, ds_config_optimal.json {config}")
    cmd = (results / "cmd_optimal.txt").read_text() if (results / "cmd_optimal.txt").is_file() else ""
    report.check(cmd.endswith(f"--deepspeed_config {results / 'ds_config_optimal.json'}\n"),
                 f"cmd_optimal.txt is not whole: {cmd!r}")
    temps = sorted(p.name for p in results.iterdir() if ".tmp" in p.name)
    report.check(not temps, f"temp files left: {temps}")
    return report.outcome()


def matrix_cases() -> list[tuple[str, str, Callable[[Path], dict]]]:
    """(kind, name, run) per scenario, for benchmarks/fault_matrix.py: ``run(root)`` plays it end to end with the
    real CLI in a fresh directory under ``root`` and returns ``{"why": [...], "lost": n, "left": n,
    "tracebacks": n}`` (``why`` empty: survived; ``lost`` counts finished records and the user's files lost or
    changed)."""
    return [
        (KIND, "--overwrite beside a user's exp.json", overwrite_beside_a_users_exp_json),
        (KIND, "two tuners, one exps dir", two_tuners_on_one_exps_dir),
        (KIND, "symlink in the exps dir", symlink_in_the_exps_dir),
        (KIND, "corrupt or foreign exp.json", corrupt_or_foreign_records),
        (KIND, "exp.json edited, digest kept", edited_records),
        (KIND, "stop signal while results are written", signal_while_results_are_written),
    ]


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


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
    expdir.write_record(exp, exps / name)
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
    assert expdir.not_own(path.parent) == ""
    record = json.loads(path.read_text())
    for content, why in ((b"\x00\xff garbage {", "its exp.json is cannot be read"),
                         (b"[" * 100_000, "its exp.json is not JSON"),
                         (json.dumps(USER_RECORD).encode(), "is not a zerotune record of experiment 'z1_gas1_tmbspg2'"),
                         (json.dumps({**record, "name": "z0"}).encode(), "not a zerotune record"),
                         (json.dumps({**record, "config_digest": 7}).encode(), "not a zerotune record")):
        path.write_bytes(content)
        assert why in expdir.not_own(path.parent), content[:40]
    path.unlink()
    assert expdir.not_own(path.parent) == "no exp.json"
    assert expdir.not_own(tmp_path / "nowhere") == "not a directory"


def test_a_record_that_does_not_verify_is_not_trusted_and_not_fatal(tmp_path, caplog):
    path = record_in(tmp_path, "z1_gas1_tmbspg2")
    assert expdir.load_record(path.parent, CONFIG).metric == 10.0
    record = json.loads(path.read_text())
    edited_config = {**record, "ds_config": {**CONFIG, "gradient_clipping": 7.0}}  # never ran; digests kept
    redigested = {**edited_config, "record_digest": expdir.record_digest(edited_config)}
    bad_status = {**record, "status": "done"}
    cases = {
        "edited ds_config": (edited_config, "does not match its record_digest"),
        "edited ds_config, record digest redone": (redigested, "its ds_config does not match its config_digest"),
        "edited metric": ({**record, "metric": 1e9}, "does not match its record_digest"),
        "unknown status": (bad_status, "does not match its record_digest"),
        "unknown status, record digest redone": ({**bad_status, "record_digest": expdir.record_digest(bad_status)},
                                                 "its fields are not an experiment's"),
        "an older zerotune's": ({k: v for k, v in record.items() if k not in ("record_version", "record_digest")},
                                "record version None, not this zerotune's 1"),
        "another version": ({**record, "record_version": 2}, "record version 2"),
        "foreign": (foreign_record(), "record version None"),
    }
    for case, (data, why) in cases.items():
        path.write_text(json.dumps(data))
        caplog.clear()
        assert expdir.load_record(path.parent, CONFIG) is None, case
        assert why in caplog.text, (case, caplog.text)
    for content in (b"\x00\xff garbage {", b"[" * 100_000, b'{"status": "ok"'):
        path.write_bytes(content)
        assert expdir.load_record(path.parent, CONFIG) is None


def test_a_record_round_trips_with_its_version_and_digest(tmp_path):
    path = record_in(tmp_path, "z1_gas1_tmbspg2", metric=float("nan"))
    record = json.loads(path.read_text())
    assert record["record_version"] == expdir.RECORD_VERSION == 1
    assert record["record_digest"] == expdir.record_digest(record) and len(record["record_digest"]) == 64
    assert expdir.untrusted(record) == ""


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
