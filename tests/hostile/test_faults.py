"""Hostile input, signals and faults (issue 13): nothing lost, nothing escapes, nothing hangs.

Three parts:

- **hostile input** (:data:`HOSTILE_INPUTS`): each bad argument or config is exit status 2 with a
  message naming the argument, file or key, before anything launches (no exps dir, no process);
  run in-process through ``zerotune.cli.main`` (benchmarks/fault_matrix.py runs the same table as
  real subprocesses);
- **the results tree**: experiment directories only ever inside the exps dir, checked on the
  resolved path; ``--overwrite`` removes zerotune's experiment directories and nothing else;
- **process faults**, with real processes: a stand-in ``deepspeed`` launcher (:data:`LAUNCHER`:
  one child per slot, forwards SIGTERM and exits, kills the others when a rank fails, as
  DeepSpeed's ``launch.py`` does) starting stand-in ranks (:data:`RANK`: write DeepSpeed's result
  files, a shared-memory file like DeepSpeed's CPU comm, or misbehave on cue). The tuner is the real
  ``zerotune`` CLI in its own process (:data:`DRIVER` only points the launcher at the stand-in), so
  a signal reaches it as it reaches a user's. Each case asserts the status, that no process of the
  run is left (found by the run token in its environment), that no ``/dev/shm`` file is left, that
  finished results survive unchanged, and, where the tuner is disturbed, the same answer as an
  undisturbed run. A tuning takes about 3 s (the tuner's own start-up, importing torch).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.faults.fault_cases import (
    HOSTILE_INPUTS,
    RANK_FAULTS,
    hostile_argv,
    lock_waiter_scheduler,
    stale_lock_is_named_then_removed,
)
from benchmarks.faults.processes import processes_of_tuner, shm_files, shm_left, stand_in_processes
from benchmarks.faults.standins import (
    ANSWER,
    BASE_CONFIG,
    DRIVER,
    LAUNCHER,
    RANK,
    answer,
    records,
    run_tuner,
    start_tuner,
    tune_argv,
)
from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.deepspeed import extensions
from zerotune.run import expdir, exprecord
from zerotune.run.backends.local import LocalBackend
from zerotune.run.processes import RUNNING_DIR
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool
from zerotune.run.store import clear_experiments, experiment_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    for name, text in (("rank.py", RANK), ("launcher.py", LAUNCHER), ("driver.py", DRIVER)):
        (tmp_path / name).write_text(text)
    (tmp_path / "ds.json").write_text(json.dumps(BASE_CONFIG))
    return tmp_path


def assert_clean(work: Path, shm_before: set[str], pid: int | None = None) -> None:
    if pid is not None:
        assert processes_of_tuner(pid) == []
    assert stand_in_processes(work) == []
    assert shm_left(work, shm_before) == set()
    for running in (work / "results" / "exps" / RUNNING_DIR).glob("*.json"):
        raise AssertionError(f"running record left: {running}")


# --- hostile input: exit 2 naming it, before anything launches ------------------------------------

@pytest.mark.parametrize("case", HOSTILE_INPUTS, ids=[c[0] for c in HOSTILE_INPUTS])
def test_hostile_input_is_exit_2_naming_it_before_anything_launches(tmp_path, capsys, case):
    _, args, config, script, message = case
    try:
        code = cli.main(hostile_argv(tmp_path, args, config, script))
    except SystemExit as e:  # argparse refused a value: its usage line, then its error line
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert re.search(r"^zerotune( tune)?: error: ", err, re.M), err[-2000:]
    assert re.search(message, err), err
    assert not (tmp_path / "results" / "exps").exists()  # nothing ran, nothing was created


def test_a_fixed_train_batch_size_that_disagrees_with_mbs_and_gas_is_said_not_silently_replaced(tmp_path):
    from zerotune.inputs.job import Job, TuneOptions
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                                  "gradient_accumulation_steps": 2}))
    job = Job.build("train.py", ["--deepspeed_config", str(tmp_path / "ds.json")], select_resources(local_slots=2),
                    TuneOptions(device_memory_bytes=2 * 2**30, cpu=True, results_dir=str(tmp_path / "r")))
    assert job.notes == (f"{tmp_path / 'ds.json'}: 'train_batch_size' = 32 disagrees with "
                         "train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x DP world size 2 = 16: "
                         "the train batch size is held fixed at 32, so gas follows each mbs tried "
                         "(32 = mbs x gas x 2)",)


def test_dry_run_never_lists_an_experiment_above_max_train_batch_size(tmp_path, capsys):
    argv = hostile_argv(tmp_path, ["--num_gpus", "2", "--device-memory", "2GiB", "--dry-run", "--json"],
                        {"autotuning": {"max_train_batch_size": 4, "model_info": {"num_params": 1000}}}, None)
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    batches = [e["mbs"] * e["gas"] * 2 for e in plan["experiments"]]
    assert batches and max(batches) <= 4, plan["experiments"]


def test_a_dry_runs_json_is_all_of_stdout_whatever_deepspeed_prints_on_import(tmp_path):
    # DeepSpeed logs "Setting accelerator to CPU" to stdout the first time its accelerator is asked for (without
    # DS_ACCELERATOR): a fresh `zerotune tune --dry-run --json` process keeps stdout for the JSON alone
    argv = hostile_argv(tmp_path, ["--num_gpus", "2", "--device-memory", "2GiB", "--dry-run", "--json"],
                        {"autotuning": {"max_train_batch_size": 4, "model_info": {"num_params": 1000}}}, None)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run([sys.executable, "-m", "zerotune", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dp_world_size"] == 2
    assert "Setting accelerator to CPU" in done.stderr


def test_garbage_and_truncated_metrics_are_named_invalid_not_missing(tmp_path):
    from zerotune.core.objective import Objective
    for content, why in ((b"\x00\xff\xfe garbage {", "cannot be read"), (b'{"throughput": 12', "not JSON")):
        (tmp_path / "metrics.json").write_bytes(content)
        exp = expdir.finish(Experiment("e", {}), tmp_path, Objective.named("throughput"), 0)
        assert exp.status is Status.FAILED
        assert exp.error.startswith(f"metrics.json is invalid: {why}"), exp.error


def test_optimal_command_names_the_script_and_config_by_absolute_path(tmp_path, monkeypatch):
    from zerotune.autotuner import Autotuner, TuneOptions
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "ds.json").write_text(json.dumps(BASE_CONFIG))
    monkeypatch.chdir(tmp_path)
    tuner = Autotuner("rank.py", ["--deepspeed_config", "ds.json"], select_resources(local_slots=1),
                      TuneOptions(device_memory_bytes=2 * 2**30, cpu=True, results_dir="results"))
    line = tuner.optimal_command("results/ds_config_optimal.json")
    assert f" {tmp_path / 'rank.py'} --deepspeed_config {tmp_path / 'results' / 'ds_config_optimal.json'}" in line
    assert " --master_port 29500 " in line  # DeepSpeed's default, where the user gave none


def test_the_users_master_port_reaches_the_answers_command_in_either_form(tmp_path, monkeypatch):
    from zerotune import cli
    from zerotune.autotuner import Autotuner, TuneOptions
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "ds.json").write_text(json.dumps(BASE_CONFIG))
    monkeypatch.chdir(tmp_path)
    # the -- deepspeed form's --master_port fills zerotune's, as its slot options do
    args, command = cli.parse(["tune", "--device-memory", "2GiB", "--", "deepspeed", "--master_port", "29611",
                               "rank.py", "--deepspeed_config", "ds.json"])
    cli._launcher_resources(args, cli.read_command(command).launcher)
    assert args.master_port == 29611
    tuner = Autotuner("rank.py", ["--deepspeed_config", "ds.json"], select_resources(local_slots=1),
                      TuneOptions(device_memory_bytes=2 * 2**30, cpu=True, results_dir="results", master_port=29611))
    assert " --master_port 29611 " in tuner.optimal_command("results/ds_config_optimal.json")


# --- the results tree: nothing created or removed outside it ---------------------------------------


def test_an_experiment_name_that_leaves_the_exps_dir_is_refused_before_anything_runs(tmp_path):
    exps = tmp_path / "results" / "exps"
    scheduler = Scheduler(LocalBackend(LaunchSpec("x.py", ("--deepspeed_config", "c.json"), cpu=True)),
                          SlotPool(select_resources(local_slots=1)), exps)
    for name in ("../../../ESCAPED", "..", ".hidden", "a/b", "", "x" * 201):
        with pytest.raises(ConfigError, match="experiment name"):
            scheduler.run([Experiment("ok_first", {}), Experiment(name, {})])
    assert not (tmp_path / "ESCAPED").exists() and not exps.exists() and scheduler.launched == 0


def test_a_symlinked_experiment_dir_is_refused_and_its_target_kept(tmp_path):
    exps, outside = tmp_path / "exps", tmp_path / "outside"
    exps.mkdir()
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (exps / "z0_gas1_tmbspg1").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"resolves to .*outside, outside the exps dir"):
        experiment_dir(exps, "z0_gas1_tmbspg1")
    scheduler = Scheduler(LocalBackend(LaunchSpec("x.py", ("--deepspeed_config", "c.json"), cpu=True)),
                          SlotPool(select_resources(local_slots=1)), exps)
    with pytest.raises(ConfigError):
        scheduler.run([Experiment("z0_gas1_tmbspg1", {})])
    assert (outside / "precious.txt").read_text() == "keep me"


def test_config_keys_never_reach_an_experiment_name(tmp_path, capsys):
    argv = hostile_argv(tmp_path, ["--num_gpus", "1", "--device-memory", "2GiB", "--dry-run", "--json"],
                        {"../../../ESCAPED": [1, 2], "a/b": {"..": [3, 4]},
                         "autotuning": {"fast": False, "model_info": {"num_params": 1000}}}, None)
    assert cli.main(argv) == 0
    names = [e["name"] for e in json.loads(capsys.readouterr().out)["experiments"]]
    assert len(names) > 3
    for name in names:
        assert experiment_dir(tmp_path / "results" / "exps", name).parent == tmp_path / "results" / "exps"
        assert "ESCAPED" not in name and "/" not in name and ".." not in name


def test_overwrite_removes_experiment_dirs_and_nothing_else(tmp_path):
    exps = tmp_path / "shared_dir"  # a config's exps_dir may name any directory
    (exps / "z0_gas1_tmbspg1").mkdir(parents=True)
    exprecord.write_record(Experiment("z0_gas1_tmbspg1", {}), exps / "z0_gas1_tmbspg1")  # zerotune's, by its content
    (exps / "user_data").mkdir()
    (exps / "user_data" / "train.bin").write_text("data")
    (exps / "notes.txt").write_text("mine")
    assert clear_experiments(exps) == ["z0_gas1_tmbspg1"]
    assert sorted(p.name for p in exps.iterdir()) == ["notes.txt", "user_data"]


# --- the extension cache: never the machine's, a stale lock removed or named --------------------------


def built_op(root: Path, name: str, torch_dir: str, deepspeed_dir: str | None = None) -> Path:
    """A stand-in for an op torch built under ``root``, built for real by ninja (its log and library as a build
    leaves them, up to date): a ``build.ninja`` naming the install's include dirs as torch writes them (a DeepSpeed
    op: its sources under ``deepspeed/ops``), its one command writing ``<name>.so``."""
    op = root / name
    op.mkdir(parents=True)
    ds = f"-I{deepspeed_dir}/ops/csrc/includes " if deepspeed_dir else ""
    (op / "build.ninja").write_text(
        f"cflags = -DTORCH_EXTENSION_NAME={name} {ds}-isystem {torch_dir}/include\n"
        + (f"sources = {deepspeed_dir}/ops/csrc/{name}.cpp\n" if ds else "")
        + f"rule link\n  command = printf '\\177ELF' > $out\nbuild {name}.so: link\ndefault {name}.so\n")
    subprocess.run(["ninja"], cwd=op, check=True, capture_output=True)
    return op


def test_experiments_get_their_own_seeded_extension_cache(tmp_path):
    here = ("/venv/site-packages/torch", "/venv/site-packages/deepspeed")
    machine = tmp_path / "machine_cache"
    built_op(machine, "fused_adam", *here)
    (machine / "fused_adam" / "lock").write_text("")  # stale, in the machine's cache
    os.utime(machine / "fused_adam" / "lock", (time.time() - 3600,) * 2)
    built_op(machine, "building", *here)
    (machine / "building" / "lock").write_text("")  # fresh: a build in progress, not copied
    built_op(machine, "no_log", *here)
    (machine / "no_log" / ".ninja_log").unlink()  # torch's load would run ninja, which would rebuild it: not copied
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in machine.rglob("*") if p.is_file()}
    ext = extensions.extensions_dir(tmp_path / "exps")
    assert extensions.seed(ext, [machine], install=here) == ["fused_adam"]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in machine.rglob("*") if p.is_file()} == before
    shutil.copytree(machine / "no_log", tmp_path / "no_log_copy")
    assert extensions.would_build(tmp_path / "no_log_copy") == "command line not found in log for no_log.so"
    # no lock; ninja's log and timestamps kept, so the copy loads with no build
    assert sorted(p.name for p in (ext / "fused_adam").iterdir()) == [".ninja_log", "build.ninja", "fused_adam.so"]
    assert extensions.would_build(ext / "fused_adam") == ""
    assert (ext / "fused_adam" / "fused_adam.so").stat().st_mtime == (machine / "fused_adam" / "fused_adam.so").stat().st_mtime
    from zerotune.core.launch import Node, Reservation
    from zerotune.deepspeed.launcher import launch_env
    env = launch_env(LaunchSpec("x.py", (), cpu=True), Reservation((Node("localhost", (0,)),)),
                     probe_dir=tmp_path / "exps" / "z0_gas1_tmbspg1")
    assert env["TORCH_EXTENSIONS_DIR"] == str(ext)
    # a backend driven by hand, without a scheduler or tuner that made the cache: torch's default
    assert "TORCH_EXTENSIONS_DIR" not in launch_env(LaunchSpec("x.py", (), cpu=True), Reservation((Node("localhost", (0,)),)),
                                                    probe_dir=tmp_path / "other" / "z0_gas1_tmbspg1")
    # every file is a copy of its own (no hard link): a write or a rebuild in the exps dir's cache leaves the
    # machine's byte-identical
    assert_private_copies(ext / "fused_adam", machine / "fused_adam")


def test_the_summary_says_which_jit_builds_a_tuning_paid_and_how_long(tmp_path):
    here = ("/venv/site-packages/torch", "/venv/site-packages/deepspeed")
    machine, ext = tmp_path / "machine_cache", extensions.extensions_dir(tmp_path / "exps")
    built_op(machine, "fused_adam", *here)
    os.utime(machine / "fused_adam" / "fused_adam.so", (1_000_000_000,) * 2)  # built long ago, elsewhere
    assert extensions.seed(ext, [machine], install=here) == ["fused_adam"]  # a seed keeps its timestamps
    started = time.time()
    op = built_op(ext, "cpu_adam", *here)  # built by this tuning's experiments: its log as ninja 1.11 writes it, ms
    (op / ".ninja_log").write_text("# ninja log v5\n0\t30012\t1796218684827458618\tcpu_adam.o\t15283e4d9fd286de\n"
                                   "30012\t31000\t1796218686997256212\tcpu_adam.so\tf1ddaf1c9ebcf7ba\n"  # a build before
                                   "1\t60880\t1796219151327480142\tcpu_adam.o\t47daf56593daa74f\n"
                                   "60880\t61437\t1796219152233228920\tcpu_adam.so\tea3dd364d2268cbb\n")
    os.utime(op / "build.ninja", (started + 1,) * 2)  # build.ninja's time is not the build's: torch rewrites it
    os.utime(op / "cpu_adam.so", (started + 62.4,) * 2)
    built_op(ext, "failed", *here)
    (ext / "failed" / "failed.so").unlink()  # no library: a build that failed or still runs
    assert extensions.builds_since(ext, started) == {"cpu_adam": 61.437}
    assert extensions.build_note(extensions.builds_since(ext, started)) == (
        "JIT builds paid by this tuning: cpu_adam 61 s (kept in zerotune's cache: the next tuning loads them)")
    assert extensions.build_note(extensions.builds_since(ext, started + 100)) is None


def assert_private_copies(copy: Path, source: Path) -> None:
    """Each file in ``copy`` is its own inode (link count 1, not its source's), and writing it in place
    leaves the source's bytes as they were."""
    files = sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file())
    assert files
    for rel in files:
        mine, theirs = (copy / rel).stat(), (source / rel).stat()
        assert (mine.st_nlink, theirs.st_nlink) == (1, 1) and mine.st_ino != theirs.st_ino
        before = (source / rel).read_bytes()
        with open(copy / rel, "r+b") as f:  # as a compiler's output rewritten in place
            f.write(b"rebuilt")
        assert (source / rel).read_bytes() == before


def test_an_op_another_install_built_is_built_once_then_seeded_from_zerotunes_own_cache(tmp_path):
    here = ("/venv/site-packages/torch", "/venv/site-packages/deepspeed")
    machine, own = tmp_path / "machine_cache", tmp_path / "zerotune_cache"
    # the machine's cache was built by a venv at another path (CI's checkout): torch would rebuild both in a copy
    built_op(machine, "deepspeed_shm_comm", "/ci/venv/site-packages/torch", "/ci/venv/site-packages/deepspeed")
    built_op(machine, "fused_adam", here[0], "/ci/venv/site-packages/deepspeed")  # the same torch, another DeepSpeed
    built_op(machine, "user_op", here[0])  # not DeepSpeed's: this torch's include dir is all it needs
    assert [extensions.built_here(machine / op, here) for op in ("deepspeed_shm_comm", "fused_adam", "user_op")] == \
        [False, False, True]
    first = extensions.extensions_dir(tmp_path / "first" / "exps")
    assert extensions.seed(first, [machine, own], install=here) == ["user_op"]
    # the first tuning's experiments build the DeepSpeed ops; at its end they are kept in zerotune's own cache
    built_op(first, "deepspeed_shm_comm", *here)
    built_op(first, "fused_adam", *here)
    (first / "fused_adam" / "lock").write_text("")  # still being built (or its build was killed): not kept
    assert extensions.publish(first, own, machine, install=here) == ["deepspeed_shm_comm"]
    assert extensions.publish(first, own, machine, install=here) == []  # kept already
    (first / "fused_adam" / "lock").unlink()
    assert extensions.publish(first, own, machine, install=here) == ["fused_adam"]
    # the next results dir: seeded, nothing rebuilt; the machine's cache was never written
    second = extensions.extensions_dir(tmp_path / "second" / "exps")
    assert sorted(extensions.seed(second, [machine, own], install=here)) == ["deepspeed_shm_comm", "fused_adam",
                                                                              "user_op"]
    assert extensions.built_here(second / "fused_adam", here)
    assert not extensions.built_here(machine / "fused_adam", here)
    # zerotune's copy of an op another install built is replaced whole by this install's build
    other = ("/other/torch", "/other/deepspeed")
    assert extensions.publish(first, own, machine, install=other) == []
    assert extensions.publish(second, own, machine, install=here) == []
    assert extensions.built_here(own / "fused_adam", here) and not (own / ".fused_adam.old").exists()
    # zerotune's cache holds copies of the exps dir's builds, and seeds copies of its own
    assert_private_copies(own / "fused_adam", first / "fused_adam")
    assert_private_copies(second / "fused_adam", own / "fused_adam")


def test_a_lock_left_by_a_killed_build_is_named_then_removed(tmp_path):
    stale_lock_is_named_then_removed(tmp_path)


def test_a_timeout_behind_a_lock_older_than_the_run_names_the_lock(tmp_path):
    with lock_waiter_scheduler(tmp_path, 1.5, 1) as (scheduler, ext):
        def lock_while_running(exp, event):  # a lock that appears once nothing could remove it, dated before the run
            if event == "start":
                (ext / "fused_adam").mkdir(parents=True, exist_ok=True)
                (ext / "fused_adam" / "lock").write_text("")
                os.utime(ext / "fused_adam" / "lock", (time.time() - 60,) * 2)
        scheduler.on_update = lock_while_running
        (done,) = scheduler.run([Experiment("waiter", {"stand_in": "waits"})])
    assert done.status is Status.TIMEOUT
    assert done.error.startswith(f"killed after the 1.5 s timeout; {ext / 'fused_adam' / 'lock'} was there before "
                                 f"it started: a torch extension lock left by a killed process"), done.error


def test_a_timeout_during_an_op_build_names_the_build_it_killed(tmp_path):
    with lock_waiter_scheduler(tmp_path, 1.5, 1) as (scheduler, ext):  # the stand-in takes torch's lock, "builds"
        (done,) = scheduler.run([Experiment("holder", {"stand_in": "dies_holding_the_lock"})])
    assert done.status is Status.TIMEOUT
    assert done.error == (f"killed after the 1.5 s timeout; it was stopped while the JIT op fused_adam was "
                          f"being built ({ext / 'fused_adam' / 'lock'} taken during the run): the build died "
                          f"with it, and the next run builds the op again; a --timeout above the build's time (about "
                          f"a minute per op on 2 cores), or the ops built once before tuning (make setup), avoids it")


def test_a_run_whose_directory_was_removed_while_it_ran_says_so(tmp_path):
    from zerotune.core.objective import OBJECTIVES
    from zerotune.run import expdir
    exp_dir = tmp_path / "exps" / "z1_gas1_tmbspg2"
    exp = Experiment("z1_gas1_tmbspg2", {"train_micro_batch_size_per_gpu": 2})
    done = expdir.finish(exp, exp_dir, OBJECTIVES["throughput"], 1)  # never there, or removed: the same
    assert (done.status, done.error) == (Status.FAILED, f"exit code 1: its directory {exp_dir} was removed while it "
                                                        f"ran, its logs and results with it")


# --- process faults through the real CLI -------------------------------------------------------------


@pytest.mark.e2e  # a real tuner process: about 6 s
def test_a_killed_process_left_a_zombie_counts_as_exited(tmp_path):
    # an orphaned launcher or rank stays a zombie until init reaps it (here, about once a second): it
    # holds nothing any more, so kill_tree must not wait for the reaping (it took 1.2 s of every stop)
    from zerotune.run.processes import _exited, _wait_exited
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # never waited for: a zombie once it exits
    proc = psutil.Process(child.pid)
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.status() == psutil.STATUS_ZOMBIE and psutil.pid_exists(child.pid)
    assert _exited(proc)
    start = time.monotonic()
    _wait_exited([proc], timeout_s=5)
    assert time.monotonic() - start < 1  # no polling until the 5 s timeout
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not _exited(psutil.Process(alive.pid))
    finally:
        alive.kill()
        alive.wait()
    child.wait()


def test_undisturbed_tuning_finds_the_stand_ins_fastest_config_and_leaves_nothing(work):
    shm = shm_files()
    code, _, err = run_tuner(work, tune_argv(work))
    assert code == 0, err[-3000:]
    assert answer(work / "results") == {"stage": ANSWER["stage"], "mbs": ANSWER["mbs"]}
    statuses = {n: r["status"] for n, r in records(work / "results").items()}
    assert set(statuses.values()) == {"ok"} and len(statuses) >= 3, statuses
    assert_clean(work, shm)


@pytest.mark.e2e  # a real tuner process: about 6 s
@pytest.mark.parametrize("fault", RANK_FAULTS, ids=[f[0] for f in RANK_FAULTS])
def test_a_rank_fault_gets_its_status_and_tuning_goes_on(work, fault):
    name, target, status, error, extra, env = fault
    shm = shm_files()
    tuner = start_tuner(work, tune_argv(work, *extra, ranks=2), plan={target: name}, **env)
    try:
        _, err = tuner.communicate(timeout=120)
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
            tuner.wait()
    code = tuner.returncode
    assert "Traceback" not in err, err[-3000:]
    recs = records(work / "results")
    hit = [r for n, r in recs.items() if n.startswith(target) and not n.endswith("_r2")]
    assert hit and hit[0]["status"] == status, ({n: (r["status"], r["error"]) for n, r in recs.items()}, err[-3000:])
    assert __import__("re").search(error, hit[0]["error"] or ""), hit[0]["error"]
    assert code == 0, err[-3000:]  # another experiment succeeded: an answer
    # the fault hits mbs 1, never the winner: the answer is the undisturbed one
    assert answer(work / "results") == {"stage": ANSWER["stage"], "mbs": ANSWER["mbs"]}
    assert_clean(work, shm, tuner.pid)  # no process of this tuner's runs left (by run token), no /dev/shm file


@pytest.mark.e2e  # a real tuner process: about 6 s
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_the_tuner_with_its_code_and_leaves_nothing_running(work, sig):
    shm = shm_files()
    # launches: the profile, z0 mbs 2, then z0 mbs 1, which is slow: stopped while it runs
    tuner = start_tuner(work, tune_argv(work, ranks=2), plan={"z0_gas1_tmbspg1": "slow"}, STANDIN_SLOW_S="60")
    exps = work / "results" / "exps"
    try:
        deadline = time.monotonic() + 60
        while not (exps / "z0_gas1_tmbspg1" / "stdout.log").exists() or \
                "step 3" not in (exps / "z0_gas1_tmbspg1" / "stdout.log").read_text():
            assert time.monotonic() < deadline and tuner.poll() is None, tuner.communicate()[1][-3000:]
            time.sleep(0.1)
        os.kill(tuner.pid, sig)
        _, err = tuner.communicate(timeout=30)
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
            tuner.wait()
    assert tuner.returncode == 128 + sig, err[-3000:]
    assert f"zerotune: interrupted ({sig.name}); finished results are kept, rerun to resume" in err
    assert "Traceback" not in err
    recs = records(work / "results")
    assert recs["z0_gas1_tmbspg1"]["status"] == "interrupted"
    assert recs["z0_gas1_tmbspg2"]["status"] == "ok" and recs["z0_gas1_tmbspg2"]["metric"] == 200.0
    assert_clean(work, shm, tuner.pid)


@pytest.mark.e2e  # a real tuner process: about 6 s
@pytest.mark.serial  # it counts every new shared-memory file as the training's
def test_zerotune_run_stopped_while_training_stops_the_training(work):
    shm = shm_files()
    tuner = start_tuner(work, ["run", *tune_argv(work, ranks=2)[1:]], STANDIN_TRAIN_S="60")
    try:
        deadline = time.monotonic() + 60
        # both training ranks are up once each has made its shared-memory file (a port no experiment used); one
        # listing for both sides: an experiment's files removed between two listings would count as the training's
        while len(training_shm := (now := shm_files()) - shm - shm_left(work, shm, now)) < 2:
            assert time.monotonic() < deadline and tuner.poll() is None, tuner.communicate()[1][-3000:]
            time.sleep(0.1)
        assert [p for p in stand_in_processes(work) if "ds_config_optimal.json" in " ".join(p.cmdline())]
        os.kill(tuner.pid, signal.SIGTERM)
        _, err = tuner.communicate(timeout=60)
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
            tuner.wait()
    assert tuner.returncode == 143, err[-3000:]
    assert "zerotune: interrupted (SIGTERM)" in err and "Traceback" not in err
    assert stand_in_processes(work) == []
    # the training's shared-memory files are gone too (its master port is in the 'running:' line)
    port = err.split("running")[1].split("--master_port ")[1].split()[0]
    assert {name.rsplit("_", 2)[1] for name in training_shm} == {port}
    assert shm_files() & training_shm == set()


@pytest.mark.e2e  # not serial: wherever a neighbour's load moves its signals, nothing may be lost
def test_a_tuner_stopped_at_random_points_then_resumed_loses_nothing_and_gives_the_same_answer(work):
    """SIGINT, SIGTERM, SIGHUP and SIGKILL at random moments (seeded), each followed by a resume;
    every finished result survives unchanged, and the answer is the undisturbed run's."""
    shm = shm_files()
    slow = {"z": "slow"}  # every experiment but the profile sleeps STANDIN_SLOW_S after its steps
    code, _, err = run_tuner(work, tune_argv(work, results="undisturbed"), plan=slow, STANDIN_SLOW_S="1")
    assert code == 0, err[-3000:]
    undisturbed = answer(work / "undisturbed")
    rng = random.Random(13)
    finished: dict[str, str] = {}
    stopped = 0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP, signal.SIGKILL):
        tuner = start_tuner(work, tune_argv(work), plan=slow, STANDIN_SLOW_S="1")
        # a random point measured in the work left, not in seconds (a loaded machine's start-up alone can outlast
        # a fixed delay): after 0 or 1 more finished experiments, then up to 1.5 s; some land before a launch
        target, deadline = len(finished_now(work)) + rng.randint(0, 1), time.monotonic() + 60
        while tuner.poll() is None and len(finished_now(work)) < target and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(tuner.pid, sig)
        tuner.communicate(timeout=60)
        assert tuner.returncode in (0, 128 + sig, -sig), tuner.returncode
        stopped += tuner.returncode != 0
        if sig is not signal.SIGKILL:  # a SIGKILLed tuner's experiments live on until the next run reaps them
            assert processes_of_tuner(tuner.pid) == []
        for name, text in finished.items():  # nothing finished is lost or changed
            assert (work / "results" / "exps" / name / "exp.json").read_text() == text, name
        finished.update(finished_now(work))
    assert stopped >= 3  # most signals landed before the tuning ended
    code, _, err = run_tuner(work, tune_argv(work))
    assert code == 0, err[-3000:]
    for name, text in finished.items():
        assert (work / "results" / "exps" / name / "exp.json").read_text() == text, name
    assert answer(work / "results") == undisturbed == {"stage": ANSWER["stage"], "mbs": ANSWER["mbs"]}
    assert_clean(work, shm)


def finished_now(work: Path) -> dict[str, str]:
    """The results directory's finished experiments (ok or out of memory): name -> exp.json's text."""
    return {p.parent.name: p.read_text() for p in (work / "results" / "exps").glob("*/exp.json")
            if json.loads(p.read_text())["status"] in ("ok", "oom")}


@pytest.mark.e2e  # a real tuner process: about 6 s
def test_a_full_results_disk_is_a_clear_error_and_keeps_what_was_written(work):
    """RLIMIT_FSIZE stands in for a full disk: every write past 64 KiB fails with EFBIG."""
    shm = shm_files()
    code, _, err = run_tuner(work, tune_argv(work))
    assert code == 0, err[-3000:]
    before = {p.parent.name: p.read_text() for p in (work / "results" / "exps").glob("*/exp.json")}
    (work / "full.py").write_text(
        "import resource, runpy, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cfg = json.loads((work / "ds.json").read_text())
    cfg["autotuning"]["max_train_micro_batch_size_per_gpu"] = 4  # new experiments to write
    (work / "ds.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, str(work / "full.py"), str(work / "driver.py"), str(work / "launcher.py"),
                           *tune_argv(work)], cwd=work, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "zerotune: tuning failed: cannot write the results: [Errno 27] File too large" in proc.stderr, \
        proc.stderr[-3000:]
    for name, text in before.items():
        assert (work / "results" / "exps" / name / "exp.json").read_text() == text, name
    assert stand_in_processes(work) == [] and shm_left(work, shm) == set()
