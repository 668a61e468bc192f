"""Hostile round two, inputs (issue 28): the scenarios tests/hostile/test_hostile_inputs.py asserts and
benchmarks/fault_matrix.py counts (:func:`matrix_cases`).

Each runs the real CLI in its own process with the stand-in launcher (:mod:`benchmarks.faults.standins`), and ranks
(:data:`RANK`) that also log the arguments they got as bytes, refuse a ZeRO stage on cue and fail the training on
cue, and returns what :func:`matrix_cases` reports.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from benchmarks.faults import standins
from benchmarks.faults.processes import shm_files, shm_left, stand_in_processes
from benchmarks.faults.standins import BASE_CONFIG, DRIVER, LAUNCHER, answer, records, run_tuner, tune_argv
from zerotune.core.experiment import ExperimentKind

KIND = "round two: inputs"
ODD = os.fsdecode(b"caf\xe9\xff")  # not UTF-8: what sys.argv and os.listdir give for such a file name
REFUSED = ('You are using an untested ZeRO Optimizer. Please add <"zero_allow_untested_optimizer": true> in the '
           'configuration file to use it.')  # DeepSpeed's refusal of a client optimizer at stages 1-3


RANK = (r'''
import json as _json, os as _os, sys as _sys
with open(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "argv.log"), "ab") as _log:
    _log.write(b"\0".join(_os.fsencode(a) for a in _sys.argv) + b"\n")  # the bytes this rank got
_stage = _json.load(open(_sys.argv[_sys.argv.index("--deepspeed_config") + 1])).get("zero_optimization", {})
if _os.environ.get("STANDIN_CLIENT_OPTIMIZER") and _stage.get("stage", 0) > 0:
    raise AssertionError(''' + repr(REFUSED) + ''')
''' + standins.RANK.replace('    sys.exit(0)\nat = config',
                      '    sys.exit(int(os.environ.get("STANDIN_TRAIN_EXIT", "0")))\nat = config'))
assert "STANDIN_TRAIN_EXIT" in RANK


def make_work(path: Path, script: str = "rank.py") -> Path:
    """A fresh directory with the stand-ins (the rank as ``script``) and the stand-ins' config."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / script).write_text(RANK)
    for name, text in (("launcher.py", LAUNCHER), ("driver.py", DRIVER)):
        (path / name).write_text(text)
    (path / "ds.json").write_text(json.dumps(BASE_CONFIG))
    return path


def outcome() -> dict:
    return {"why": [], "lost": 0, "left": 0, "tracebacks": 0}


def run_cli(work: Path, argv: list[str], out: dict, **env) -> tuple[int, str]:
    """The real CLI (the stand-ins' driver) to its end; counts tracebacks, processes and /dev/shm files
    left into ``out``."""
    shm = shm_files()
    code, _, err = run_tuner(work, argv, **env)
    left = {p.pid for p in stand_in_processes(work)}  # the launchers and ranks the runs started
    out["left"] += len(left)
    out["tracebacks"] += "Traceback" in err
    for why, bad in (("traceback", "Traceback" in err), (f"{len(left)} process(es) left", left),
                     (f"/dev/shm left: {sorted(shm_left(work, shm))}", shm_left(work, shm))):
        if bad:
            out["why"].append(why)
    return code, err


def expect(out: dict, ok: bool, why: str) -> bool:
    if not ok:
        out["why"].append(why)
    return ok


def stage0_client_optimizer(root: Path) -> dict:
    """A stage-0-only job whose ranks refuse ZeRO stages 1-3 (a client optimizer): tuned, the profile at stage 0."""
    out, work = outcome(), make_work(root / "stage0-client-optimizer")
    cfg = {**BASE_CONFIG, "zero_optimization": {"stage": 0}}
    (work / "ds.json").write_text(json.dumps(cfg))
    code, err = run_cli(work, tune_argv(work, ranks=2), out, STANDIN_CLIENT_OPTIMIZER="1")
    recs = records(work / "results")
    profiles = [r for r in recs.values() if r["kind"] == ExperimentKind.PROFILE.value]
    if expect(out, code == 0, f"exit {code}: {err[-300:]}"):
        expect(out, answer(work / "results") == {"stage": 0, "mbs": 2}, f"answer {answer(work / 'results')}")
    expect(out, [(p["ds_config"]["zero_optimization"]["stage"], p["status"]) for p in profiles] == [(0, "ok")],
           f"profile runs {[(p['name'], p['status']) for p in profiles]}")
    expect(out, all(r["ds_config"]["zero_optimization"]["stage"] == 0 for r in recs.values()),
           "an experiment at a stage the job does not tune")
    return out


def non_utf8_paths_and_arguments(root: Path) -> dict:
    """The script's file name, a script argument and the results dir hold bytes that are not UTF-8: every launch
    gets those bytes, the commands written stay text, a rerun resumes without a launch and changes nothing."""
    out, work = outcome(), make_work(root / "non-utf8", script=f"{ODD}.py")
    results = work / f"results-{ODD}"
    argv = tune_argv(work, results=results.name) + ["--tag", ODD]
    argv[argv.index(str(work / "rank.py"))] = str(work / f"{ODD}.py")
    code, err = run_cli(work, argv, out)
    if not expect(out, code == 0, f"exit {code}: {err[-300:]}"):
        return out
    launches = (work / "argv.log").read_bytes().splitlines()
    want = [os.fsencode(work / f"{ODD}.py"), b"--tag", b"caf\xe9\xff"]
    expect(out, launches and all(line.split(b"\0")[0] == want[0] and line.split(b"\0")[-2:] == want[1:]
                                 for line in launches), f"a launch got other bytes: {launches[:2]}")
    for cmd in [*(results / "exps").glob("*/cmd.txt"), results / "cmd_optimal.txt"]:
        text = cmd.read_bytes().decode("utf-8", "replace")
        expect(out, "--tag $'caf\\xe9\\xff'" in text and "\ufffd" not in text, f"{cmd.name} is not the text: {text}")
    finished = {p: p.read_bytes() for p in (results / "exps").glob("*/exp.json")}
    code, err = run_cli(work, argv, out)
    expect(out, code == 0 and "(0 launched now)" in err, f"the rerun: exit {code}, {err[-300:]}")
    expect(out, len(work.joinpath("argv.log").read_bytes().splitlines()) == len(launches), "the rerun launched")
    out["lost"] = sum(1 for p, text in finished.items() if not p.exists() or p.read_bytes() != text)
    expect(out, out["lost"] == 0, f"{out['lost']} finished result(s) lost or changed")
    return out


def non_utf8_config(root: Path) -> dict:
    """A ds_config file holding a byte that is not UTF-8 (DeepSpeed cannot read it either): exit 2 naming it."""
    out, work = outcome(), make_work(root / "non-utf8-config")
    (work / "ds.json").write_bytes(json.dumps({**BASE_CONFIG, "note": "X"}).encode().replace(b'"X"', b'"\xff"'))
    code, err = run_cli(work, tune_argv(work), out)
    expect(out, code == 2, f"exit {code}")
    expect(out, f"zerotune: error: {work / 'ds.json'}: not UTF-8 (byte 0xff at offset" in err, f"message: {err[-300:]}")
    expect(out, not (work / "results" / "exps").exists(), "something was created or launched")
    return out


def failed_training(root: Path) -> dict:
    """``zerotune run`` whose training exits 2: exit status 3 and a line with the training's own status."""
    out, work = outcome(), make_work(root / "failed-training")
    code, err = run_cli(work, ["run", *tune_argv(work, ranks=2)[1:]], out, STANDIN_TRAIN_EXIT="2")
    expect(out, code == 3, f"exit {code}")  # cli.TRAINING_FAILED
    expect(out, f"zerotune: training failed: the launcher exited with status 2; the tuning's results are kept in "
                f"{work / 'results'} (ds_config_optimal.json, cmd_optimal.txt)" in err, f"no line: {err[-300:]}")
    expect(out, (work / "results" / "ds_config_optimal.json").exists(), "the optimal config is gone")
    return out


def matrix_cases() -> list[tuple[str, str, Callable[[Path], dict]]]:
    """(kind, name, run) per scenario for benchmarks/fault_matrix.py: ``run(root)`` runs it end to end with the
    real CLI in a fresh directory under ``root`` and returns ``{"why": [...], "lost": n, "left": n,
    "tracebacks": n}`` (``why`` empty when it survived)."""
    return [(KIND, "stage-0 job, ZeRO refused", stage0_client_optimizer),
            (KIND, "non-UTF-8 path and argument", non_utf8_paths_and_arguments),
            (KIND, "non-UTF-8 config file", non_utf8_config),
            (KIND, "run: training fails", failed_training)]


if __name__ == "__main__":  # python -m benchmarks.faults.hostile_inputs ROOT: the matrix cases, one line each
    for kind, name, run in matrix_cases():
        print(kind, "|", name, "|", run(Path(sys.argv[1])), flush=True)
