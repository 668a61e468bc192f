"""Hostile round two (issue 28): inputs that plain ``deepspeed`` accepts are tuned, and a failed training is said.

- a job whose stages exclude ZeRO-3, with a config DeepSpeed refuses at a stage the job does not tune (a client
  optimizer ZeRO does not support): the profile runs at a stage the job tunes, so the job is tuned;
- paths and script arguments that are not UTF-8 (legal Linux file names; Python gives them as surrogate
  escapes): every launch gets the very bytes, ``cmd.txt`` and ``cmd_optimal.txt`` stay text a shell turns
  back into those bytes, a rerun resumes; a ds_config file that is not UTF-8 is exit status 2 naming it;
- ``zerotune run`` whose training fails: exit status 3 (:data:`zerotune.cli.TRAINING_FAILED`) and a line with
  the training's own status.

The scenarios (:mod:`benchmarks.faults.hostile_inputs`) run the real CLI in its own process with the stand-in
launcher, and ranks that also log the arguments they got as bytes, refuse a ZeRO stage on cue and fail the training
on cue. Each scenario returns what :func:`~benchmarks.faults.hostile_inputs.matrix_cases` reports; the tests assert it is
clean.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks.faults.fault_cases import hostile_argv
from benchmarks.faults.hostile_inputs import (
    ODD,
    failed_training,
    non_utf8_paths_and_arguments,
    outcome,
    stage0_client_optimizer,
)
from benchmarks.faults.standins import BASE_CONFIG
from zerotune import cli
from zerotune.deepspeed import launcher
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job, TuneOptions
from zerotune.run.resources import select_resources

# --- item 4: the profile runs at a stage the job tunes ------------------------------------------------


@pytest.mark.e2e  # a real tuner process: about 5 s
def test_a_stage0_job_deepspeed_refuses_under_zero_is_tuned_with_its_profile_at_stage_0(tmp_path):
    assert stage0_client_optimizer(tmp_path) == outcome()


@pytest.mark.parametrize("stages, profiled", [(0, 0), ([1, 2], 2), ([0, 1], 1), ("all", 3), ([0, 3], 3)])
def test_the_profile_runs_at_stage_3_where_the_job_tunes_it_else_at_its_highest_stage(tmp_path, stages, profiled):
    (tmp_path / "ds.json").write_text(json.dumps({**BASE_CONFIG, "zero_optimization": {"stage": stages}}))
    job = Job.build("train.py", ["--deepspeed_config", str(tmp_path / "ds.json")], select_resources(local_slots=2),
                    TuneOptions(device_memory_bytes=2 * 2**30, cpu=True, results_dir=str(tmp_path / "r")))
    profile = ConfigBuilder(job).profile()
    assert profile.ds_config["zero_optimization"]["stage"] == profiled
    assert profile.name.startswith(f"profile_z{profiled}_")


# --- item 8: bytes that are not UTF-8 in paths and arguments -------------------------------------------


@pytest.mark.e2e  # two real tuner processes: about 8 s
def test_paths_and_arguments_that_are_not_utf8_reach_every_launch_and_resume(tmp_path):
    assert non_utf8_paths_and_arguments(tmp_path) == outcome()


def test_a_config_file_that_is_not_utf8_is_exit_2_naming_it(tmp_path, capsys):
    argv = hostile_argv(tmp_path, ["--num_gpus", "1", "--device-memory", "2GiB"], {}, None)
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


@pytest.mark.e2e  # a real tuner process: about 5 s
def test_zerotune_run_whose_training_fails_exits_3_and_says_so(tmp_path):
    assert failed_training(tmp_path) == outcome()


def test_a_training_killed_by_a_signal_is_named(tmp_path, capsys):
    assert cli.training_status(0, tmp_path) == 0 and capsys.readouterr().err == ""
    assert cli.training_status(-9, tmp_path) == cli.TRAINING_FAILED == 3
    assert "zerotune: training failed: the launcher was killed by SIGKILL;" in capsys.readouterr().err
    assert cli.training_status(247, tmp_path) == 3
    assert "the launcher exited with status 247;" in capsys.readouterr().err


