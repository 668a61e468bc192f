"""Hostile records and results (issue 28, round two): the scenarios tests/hostile/test_hostile_records.py asserts and
benchmarks/fault_matrix.py prints as rows (:func:`matrix_cases`).

Each runs the real CLI with the stand-in launcher (:mod:`benchmarks.faults.standins`) in a fresh directory and returns
what went wrong.
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Callable

from benchmarks.faults.processes import stand_in_processes
from benchmarks.faults.standins import BASE_CONFIG, DRIVER, LAUNCHER, RANK, run_tuner
from zerotune.run import store

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


def make_work(root: Path, name: str, **autotuning) -> Path:
    """A fresh directory under ``root`` with the stand-ins and ``ds.json`` (BASE_CONFIG, ``autotuning`` merged)."""
    work = root / name
    work.mkdir(parents=True)
    for file, text in (("rank.py", RANK), ("launcher.py", LAUNCHER), ("driver.py", HOOKED_DRIVER)):
        (work / file).write_text(text)
    write_standin_config(work, "ds.json", **autotuning)
    return work


def write_standin_config(work: Path, name: str, **autotuning) -> Path:
    """``work/name``: the stand-ins' BASE_CONFIG with ``autotuning`` merged into its ``autotuning``."""
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
            if (store.read_json(p) or {}).get("status") in ("ok", "oom")}


def recorded(exps: Path) -> dict[str, dict]:
    """Each experiment directory's exp.json content, by name ({} where it is not a JSON object)."""
    return {p.parent.name: store.read_json(p) or {} for p in exps.glob("*/exp.json")}


def optimal(results: Path) -> tuple[int, int] | None:
    """(stage, mbs) of ds_config_optimal.json; None without one."""
    cfg = store.read_json(results / "ds_config_optimal.json")
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
    write_standin_config(work, "second.json", results_dir="second")
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
    answer = store.read_json(work / "results" / "ds_config_optimal.json") or {}
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
    write_standin_config(work, "ds.json", results_dir="results", exps_dir="results/exps",
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
