"""Hostile round two (issue 28): inputs that plain ``deepspeed`` accepts are tuned, and a failed training is said.

- a job whose stages exclude ZeRO-3, with a config DeepSpeed refuses at a stage the job does not tune (a client
  optimizer ZeRO does not support): the profile runs at a stage the job tunes, so the job is tuned;
- paths and script arguments that are not UTF-8 (legal Linux file names; Python gives them as surrogate
  escapes): every launch gets the very bytes, ``cmd.txt`` and ``cmd_optimal.txt`` stay text a shell turns
  back into those bytes, a rerun resumes; a ds_config file that is not UTF-8 is exit status 2 naming it;
- ``zerotune run`` whose training fails: exit status 3 (:data:`zerotune.cli.TRAINING_FAILED`) and a line with
  the training's own status.

The scenarios run the real CLI in its own process with tests/test_faults.py's stand-in launcher, and ranks
(:data:`RANK`) that also log the arguments they got as bytes, refuse a ZeRO stage on cue and fail the training on
cue. Each scenario returns what :func:`matrix_cases` reports; the tests assert it is clean.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests import test_faults as tf
from zerotune import cli
from zerotune.core.experiment import ExperimentKind
from zerotune.deepspeed import launcher
from zerotune.run.resources import select_resources
from zerotune.strategy.configs import ConfigBuilder
from zerotune.strategy.job import Job, TuneOptions

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
''' + tf.RANK.replace('    sys.exit(0)\nat = config',
                      '    sys.exit(int(os.environ.get("STANDIN_TRAIN_EXIT", "0")))\nat = config'))
assert "STANDIN_TRAIN_EXIT" in RANK


def make_work(path: Path, script: str = "rank.py") -> Path:
    """A fresh directory with the stand-ins (the rank as ``script``) and tests/test_faults.py's config."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / script).write_text(RANK)
    for name, text in (("launcher.py", tf.LAUNCHER), ("driver.py", tf.DRIVER)):
        (path / name).write_text(text)
    (path / "ds.json").write_text(json.dumps(tf.BASE_CONFIG))
    return path


def outcome() -> dict:
    return {"why": [], "lost": 0, "left": 0, "tracebacks": 0}


def run_cli(work: Path, argv: list[str], out: dict, **env) -> tuple[int, str]:
    """The real CLI (tests/test_faults.py's driver) to its end; counts tracebacks, processes and /dev/shm files
    left into ``out``."""
    shm = tf.shm_files()
    code, _, err = tf.run_tuner(work, argv, **env)
    left = {p.pid for p in tf.stand_in_processes(work)}  # the launchers and ranks the runs started
    out["left"] += len(left)
    out["tracebacks"] += "Traceback" in err
    for why, bad in (("traceback", "Traceback" in err), (f"{len(left)} process(es) left", left),
                     (f"/dev/shm left: {sorted(tf.shm_left(work, shm))}", tf.shm_left(work, shm))):
        if bad:
            out["why"].append(why)
    return code, err


def expect(out: dict, ok: bool, why: str) -> bool:
    if not ok:
        out["why"].append(why)
    return ok


# --- item 4: the profile runs at a stage the job tunes ------------------------------------------------

def stage0_client_optimizer(root: Path) -> dict:
    """A stage-0-only job whose ranks refuse ZeRO stages 1-3 (a client optimizer): tuned, the profile at stage 0."""
    out, work = outcome(), make_work(root / "stage0-client-optimizer")
    cfg = {**tf.BASE_CONFIG, "zero_optimization": {"stage": 0}}
    (work / "ds.json").write_text(json.dumps(cfg))
    code, err = run_cli(work, tf.tune_argv(work, ranks=2), out, STANDIN_CLIENT_OPTIMIZER="1")
    recs = tf.records(work / "results")
    profiles = [r for r in recs.values() if r["kind"] == ExperimentKind.PROFILE.value]
    if expect(out, code == 0, f"exit {code}: {err[-300:]}"):
        expect(out, tf.answer(work / "results") == {"stage": 0, "mbs": 2}, f"answer {tf.answer(work / 'results')}")
    expect(out, [(p["ds_config"]["zero_optimization"]["stage"], p["status"]) for p in profiles] == [(0, "ok")],
           f"profile runs {[(p['name'], p['status']) for p in profiles]}")
    expect(out, all(r["ds_config"]["zero_optimization"]["stage"] == 0 for r in recs.values()),
           "an experiment at a stage the job does not tune")
    return out


@pytest.mark.e2e  # a real tuner process: about 5 s
def test_a_stage0_job_deepspeed_refuses_under_zero_is_tuned_with_its_profile_at_stage_0(tmp_path):
    assert stage0_client_optimizer(tmp_path) == outcome()


@pytest.mark.parametrize("stages, profiled", [(0, 0), ([1, 2], 2), ([0, 1], 1), ("all", 3), ([0, 3], 3)])
def test_the_profile_runs_at_stage_3_where_the_job_tunes_it_else_at_its_highest_stage(tmp_path, stages, profiled):
    (tmp_path / "ds.json").write_text(json.dumps({**tf.BASE_CONFIG, "zero_optimization": {"stage": stages}}))
    job = Job.build("train.py", ["--deepspeed_config", str(tmp_path / "ds.json")], select_resources(local_slots=2),
                    TuneOptions(device_memory_bytes=2 * 2**30, cpu=True, results_dir=str(tmp_path / "r")))
    profile = ConfigBuilder(job).profile()
    assert profile.ds_config["zero_optimization"]["stage"] == profiled
    assert profile.name.startswith(f"profile_z{profiled}_")


# --- item 8: bytes that are not UTF-8 in paths and arguments -------------------------------------------

def non_utf8_paths_and_arguments(root: Path) -> dict:
    """The script's file name, a script argument and the results dir hold bytes that are not UTF-8: every launch
    gets those bytes, the commands written stay text, a rerun resumes without a launch and changes nothing."""
    out, work = outcome(), make_work(root / "non-utf8", script=f"{ODD}.py")
    results = work / f"results-{ODD}"
    argv = tf.tune_argv(work, results=results.name) + ["--tag", ODD]
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


@pytest.mark.e2e  # two real tuner processes: about 8 s
def test_paths_and_arguments_that_are_not_utf8_reach_every_launch_and_resume(tmp_path):
    assert non_utf8_paths_and_arguments(tmp_path) == outcome()


def non_utf8_config(root: Path) -> dict:
    """A ds_config file holding a byte that is not UTF-8 (DeepSpeed cannot read it either): exit 2 naming it."""
    out, work = outcome(), make_work(root / "non-utf8-config")
    (work / "ds.json").write_bytes(json.dumps({**tf.BASE_CONFIG, "note": "X"}).encode().replace(b'"X"', b'"\xff"'))
    code, err = run_cli(work, tf.tune_argv(work), out)
    expect(out, code == 2, f"exit {code}")
    expect(out, f"zerotune: error: {work / 'ds.json'}: not UTF-8 (byte 0xff at offset" in err, f"message: {err[-300:]}")
    expect(out, not (work / "results" / "exps").exists(), "something was created or launched")
    return out


def test_a_config_file_that_is_not_utf8_is_exit_2_naming_it(tmp_path, capsys):
    argv = tf.hostile_argv(tmp_path, ["--num_gpus", "1", "--device-memory", "2GiB"], {}, None)
    (tmp_path / "ds.json").write_bytes(b'{"train_micro_batch_size_per_gpu": 1, "note": "caf\xe9"}')
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"zerotune: error: {tmp_path / 'ds.json'}: not UTF-8 (byte 0xe9 at offset 50); a DeepSpeed "
                   "config is UTF-8 JSON (non-ASCII text may be written as \\uXXXX)\n")
    assert not (tmp_path / "results" / "exps").exists()


def test_a_pasted_command_gives_the_program_the_bytes_it_was_given():
    words = [ODD, f"it's {ODD} a\\b", "plain", "two words", "", "new\nline", "caf\u00e9"]
    for env, cmd, want in (({}, ["printf", "%s\\0", *words], b"".join(os.fsencode(w) + b"\0" for w in words)),
                           ({"VAR": ODD}, ["printenv", "VAR"], os.fsencode(ODD) + b"\n")):
        line = launcher.paste_command(env, cmd)
        line.encode()  # text, whatever the bytes
        assert subprocess.run(["bash", "-c", line], capture_output=True, check=True).stdout == want
    assert launcher.shell_word(ODD) == "$'caf\\xe9\\xff'" and launcher.shell_word("a b") == "'a b'"


# --- item 9: zerotune run's failed training -------------------------------------------------------------

def failed_training(root: Path) -> dict:
    """``zerotune run`` whose training exits 2: exit status 3 and a line with the training's own status."""
    out, work = outcome(), make_work(root / "failed-training")
    code, err = run_cli(work, ["run", *tf.tune_argv(work, ranks=2)[1:]], out, STANDIN_TRAIN_EXIT="2")
    expect(out, code == 3, f"exit {code}")  # cli.TRAINING_FAILED
    expect(out, f"zerotune: training failed: the launcher exited with status 2; the tuning's results are kept in "
                f"{work / 'results'} (ds_config_optimal.json, cmd_optimal.txt)" in err, f"no line: {err[-300:]}")
    expect(out, (work / "results" / "ds_config_optimal.json").exists(), "the optimal config is gone")
    return out


@pytest.mark.e2e  # a real tuner process: about 5 s
def test_zerotune_run_whose_training_fails_exits_3_and_says_so(tmp_path):
    assert failed_training(tmp_path) == outcome()


def test_a_training_killed_by_a_signal_is_named(tmp_path, capsys):
    assert cli.training_status(0, tmp_path) == 0 and capsys.readouterr().err == ""
    assert cli.training_status(-9, tmp_path) == cli.TRAINING_FAILED == 3
    assert "zerotune: training failed: the launcher was killed by SIGKILL;" in capsys.readouterr().err
    assert cli.training_status(247, tmp_path) == 3
    assert "the launcher exited with status 247;" in capsys.readouterr().err


# --- the fault matrix ------------------------------------------------------------------------------------

def matrix_cases() -> list[tuple[str, str, Callable[[Path], dict]]]:
    """(kind, name, run) per scenario for benchmarks/fault_matrix.py: ``run(root)`` runs it end to end with the
    real CLI in a fresh directory under ``root`` and returns ``{"why": [...], "lost": n, "left": n,
    "tracebacks": n}`` (``why`` empty when it survived)."""
    return [(KIND, "stage-0 job, ZeRO refused", stage0_client_optimizer),
            (KIND, "non-UTF-8 path and argument", non_utf8_paths_and_arguments),
            (KIND, "non-UTF-8 config file", non_utf8_config),
            (KIND, "run: training fails", failed_training)]


if __name__ == "__main__":  # python -m tests.test_hostile_inputs ROOT: the matrix cases, one line each
    for kind, name, run in matrix_cases():
        print(kind, "|", name, "|", run(Path(sys.argv[1])), flush=True)
