"""The Slurm backend: the rank wrapper's environment and the srun line (exact values, no Slurm needed), and,
marked e2e, tunings through a real one-node Slurm cluster (``.ci/slurm_up.sh`` starts it as root; ``make test``
runs that first) with real DeepSpeed on 2 CPU ranks.

The e2e tests are skipped, saying why, when ``sinfo`` is absent or the cluster has no usable node.
"""
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.faults.processes import processes_running
from tests.helpers.cluster_env import run_env
from tests.helpers.services import need
from tests.helpers.tiny import SCRIPT, TINY, best_pooled, write_config
from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.deepspeed.launcher import MIMALLOC_RESERVE_ENV
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV, PROBE_PATH, read_streams
from zerotune.run.backends import stop_handles
from zerotune.run.backends.local import _Supervised
from zerotune.run.backends.slurm import SlurmBackend, slurm_nodes, srun_command, step_env
from zerotune.run.backends.slurm_rank import DATA_LIMIT_ENV, expand_counts, rank_env
from zerotune.run.backends.slurm_step import slurm_step_id, step_handle
from zerotune.run.backends.slurm_warm import server_step_command
from zerotune.run.processes import reap_orphans, write_running_record
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool
from zerotune.run.warm.rank import SETUP_FAILED, SETUP_FAILED_LINE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("cluster")  # one worker for the Slurm and Ray tests: one cluster each
PY = sys.executable


def spec_for(script: str = "train.py", **kw) -> LaunchSpec:
    return LaunchSpec(script=script, script_args=("--steps", "6", "--deepspeed_config", "ds.json"), **kw)


# -- the rank wrapper and the srun line, without Slurm ---------------------------------------------------------

def test_counts_expand_as_slurm_compresses_them():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("8") == [8]


def test_rank_env_is_what_deepspeeds_launcher_gives_the_second_rank_of_the_second_node():
    task = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_NODES": "2"}
    assert rank_env(task) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
                              "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    # without the step's own variables (an older srun), the job's
    job = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "3",
           "SLURM_TASKS_PER_NODE": "3", "SLURM_NNODES": "1"}
    assert rank_env(job) == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_SIZE": "3",
                             "CROSS_RANK": "0", "CROSS_SIZE": "1"}


def test_the_wrapper_execs_the_script_with_local_rank_its_env_and_data_limit(tmp_path):
    show = tmp_path / "show.py"
    show.write_text("import json, os, resource, sys\n"
                    "print(json.dumps({'argv': sys.argv, 'data': resource.getrlimit(resource.RLIMIT_DATA)[0],\n"
                    "                  'env': {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE',\n"
                    "                          'LOCAL_SIZE', 'CROSS_RANK', 'CROSS_SIZE', 'MASTER_ADDR')}}))\n")
    task = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1", "MASTER_ADDR": "node-a",
            DATA_LIMIT_ENV: str(3 * 2**30), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([PY, "-u", "-m", "zerotune.run.backends.slurm_rank", str(show), "--steps", "6"],
                         env={**os.environ, **task}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["argv"] == [str(show), "--local_rank=1", "--steps", "6"]
    assert seen["data"] == 3 * 2**30
    assert seen["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                           "CROSS_SIZE": "1", "MASTER_ADDR": "node-a"}


@pytest.fixture
def node_server(tmp_path):
    """A warm rank server as a Slurm step's task runs it (``{node}`` socket, ``--parent 0``, ``--ready``), for a
    script that prints its rank's contract; yields (its socket template, the script); stopped at the end."""
    show = tmp_path / "show.py"
    show.write_text("import json, os, resource, sys\n"
                    "print(json.dumps({'argv': sys.argv, 'data': resource.getrlimit(resource.RLIMIT_DATA)[0],\n"
                    "                  'env': {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE',\n"
                    "                          'LOCAL_SIZE', 'CROSS_RANK', 'CROSS_SIZE', 'MASTER_ADDR')}}))\n"
                    "sys.exit(int(os.environ.get('EXIT_WITH', '0')))\n")
    template = str(tmp_path / "sock" / "{node}.sock")
    server = subprocess.Popen([PY, "-m", "zerotune.run.warm.server", "--socket", template, "--script", str(show),
                               "--parent", "0", "--ready", str(tmp_path / "ready")],
                              env={**os.environ, "SLURMD_NODENAME": "node-a", "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready" / "node-a.json").exists():
            assert server.poll() is None and time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.05)
        yield template, show
    finally:
        server.terminate()
        server.wait(timeout=30)


TASK = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1", "MASTER_ADDR": "node-a",
        DATA_LIMIT_ENV: str(3 * 2**30), "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "node-a"}


def test_the_warm_wrapper_has_its_nodes_server_fork_the_rank_with_the_same_contract(node_server):
    template, show = node_server
    cmd = [PY, "-u", "-m", "zerotune.run.backends.slurm_rank", "--warm", template, str(show), "--steps", "6"]
    run = subprocess.run(cmd, env={**os.environ, **TASK}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)  # written by the forked rank into the task's own stdout (passed to the server)
    assert seen["argv"] == [str(show), "--local_rank=1", "--steps", "6"]
    assert seen["data"] == 3 * 2**30
    assert seen["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                           "CROSS_SIZE": "1", "MASTER_ADDR": "node-a"}
    failed = subprocess.run(cmd, env={**os.environ, **TASK, "EXIT_WITH": "3"}, capture_output=True, timeout=60)
    assert failed.returncode == 3


def test_a_torchrun_contract_task_gets_torchruns_variables_and_no_local_rank_cold_and_warm(tmp_path, node_server):
    show = tmp_path / "show_torchrun.py"
    show.write_text("import json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv, 'env': {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK',\n"
                    "                  'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'ROLE_WORLD_SIZE')}}))\n")
    run = subprocess.run([PY, "-u", "-m", "zerotune.run.backends.slurm_rank", "--contract", "torchrun", str(show),
                          "--steps", "6"], env={**os.environ, **TASK}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"argv": [str(show), "--steps", "6"], "env": {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "ROLE_WORLD_SIZE": "2"}}
    template, warm_show = node_server
    warm = subprocess.run([PY, "-u", "-m", "zerotune.run.backends.slurm_rank", "--warm", template, "--contract",
                           "torchrun", str(warm_show), "--steps", "6"], env={**os.environ, **TASK}, capture_output=True,
                          text=True, timeout=60)
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["argv"] == [str(warm_show), "--steps", "6"]


def test_the_warm_wrapper_without_a_server_exits_setup_failed_saying_why(tmp_path):
    run = subprocess.run([PY, "-m", "zerotune.run.backends.slurm_rank", "--warm", str(tmp_path / "{node}.sock"),
                          "train.py"], env={**os.environ, **TASK}, capture_output=True, text=True, timeout=60)
    assert run.returncode == SETUP_FAILED
    assert run.stderr.startswith(f"{SETUP_FAILED_LINE}: the warm server on node-a did not launch the rank: "
                                 f"FileNotFoundError: "), run.stderr


def test_the_wrapper_outside_a_step_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run = subprocess.run([PY, "-m", "zerotune.run.backends.slurm_rank", "train.py"], env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "not a task of a Slurm step (KeyError: 'SLURM_NODEID'); it is started by srun" in run.stderr


def test_srun_line_of_a_two_node_cpu_step():
    two = Reservation((Node("node-a", (0, 1)), Node("node-b", (0, 1))))
    assert srun_command(spec_for(cpu=True), two, "/exps/e/ds_config.json", 4, "zerotune-e-1234abcd") == [
        "srun", "--nodes", "2", "--ntasks", "4", "--ntasks-per-node", "2", "--nodelist", "node-a,node-b",
        "--kill-on-bad-exit=1", "--exact", "--cpus-per-task", "4", "--job-name", "zerotune-e-1234abcd",
        "--export=ALL", PY, "-u", "-m", "zerotune.run.backends.slurm_rank", "train.py",
        "--steps", "6", "--deepspeed_config", "/exps/e/ds_config.json"]


def test_the_warm_servers_step_overlaps_one_task_per_node():
    assert server_step_command(["node-a", "node-b"], "zerotune-warm-1", "/tmp/zw/{node}.sock", "train.py",
                               Path("/exps/.zerotune-warm-1"), gpus_per_node=4) == [
        "srun", "--overlap", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--nodelist", "node-a,node-b",
        "--job-name", "zerotune-warm-1", "--gpus-per-node", "4", "--gpu-bind=none", "--export=ALL", PY, "-u", "-m",
        "zerotune.run.warm.server", "--socket", "/tmp/zw/{node}.sock", "--script", "train.py", "--parent", "0",
        "--ready", "/exps/.zerotune-warm-1"]


def test_srun_line_of_a_torchrun_job_asks_the_wrapper_for_torchruns_contract():
    from zerotune.launchers.command import read_command
    user = read_command(["torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed_config", "ds.json"])
    spec = LaunchSpec(script="train.py", script_args=user.script_args, cpu=True, launcher=user.launcher)
    cmd = srun_command(spec, Reservation((Node("node-a", (0, 1)),)), "/exp/ds.json", 1, "zerotune-x")
    assert cmd[cmd.index("zerotune.run.backends.slurm_rank"):] == [
        "zerotune.run.backends.slurm_rank", "--contract", "torchrun", "train.py", "--deepspeed_config", "/exp/ds.json"]


def test_srun_line_on_cuda_asks_for_the_gpus_per_node():
    one = Reservation((Node("gpu-7", (0, 1, 2, 3)),))
    cmd = srun_command(spec_for(), one, "/exps/e/ds_config.json", 8, "zerotune-e-1")
    assert cmd[:14] == ["srun", "--nodes", "1", "--ntasks", "4", "--ntasks-per-node", "4", "--nodelist", "gpu-7",
                        "--kill-on-bad-exit=1", "--exact", "--cpus-per-task", "8", "--gpus-per-node"]
    assert cmd[14] == "4"


def test_step_env_injects_the_probe_as_the_local_backend_does(tmp_path):
    exp_dir = tmp_path / "exps" / "z1_mbs1"
    (tmp_path / "exps" / ".torch_extensions").mkdir(parents=True)
    one = Reservation((Node("node-a", (0, 1)),))
    env = step_env(spec_for(cpu=True, device_memory_bytes=3 * 2**30), one, 29611, probe_dir=exp_dir)
    inherited = os.environ.get("PYTHONPATH", "")
    assert env == {"PYTHONPATH": os.pathsep.join(p for p in (str(PROBE_PATH), inherited) if p),
                   PROBE_DIR_ENV: str(exp_dir.resolve()),
                   "TORCH_EXTENSIONS_DIR": str((tmp_path / "exps" / ".torch_extensions").resolve()),
                   "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "MASTER_ADDR": "node-a", "MASTER_PORT": "29611",
                   DATA_LIMIT_ENV: str(3 * 2**30), MIMALLOC_RESERVE_ENV: "0"}
    # on CUDA the probe caps the allocator instead; the training after tuning gets neither probe nor limit
    cuda = step_env(spec_for(device_memory_bytes=40 * 2**30), one, 29611, probe_dir=exp_dir)
    assert cuda[BUDGET_ENV] == str(40 * 2**30) and DATA_LIMIT_ENV not in cuda
    assert step_env(spec_for(cpu=True, device_memory_bytes=3 * 2**30), one, 29500) == {
        "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}


def test_a_step_srun_cannot_create_as_the_allocation_ends_is_interrupted_not_failed(tmp_path):
    backend = SlurmBackend(spec_for(cpu=True), environ={"SLURM_JOB_ID": "42", "SLURM_JOB_CPUS_PER_NODE": "2"})
    exp_dir = tmp_path / "z1_gas1_tmbspg2"
    exp_dir.mkdir()
    (exp_dir / "stdout.log").write_text("")
    line = "srun: error: Unable to create step for job 42: Job/step already completing or completed"
    (exp_dir / "stderr.log").write_text(line + "\n")
    exp = Experiment("z1_gas1_tmbspg2", {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4}, num_slots=2)
    done = backend._finish(exp, exp_dir, 1, time.monotonic(), _Supervised())
    assert (done.status, done.error) == (Status.INTERRUPTED, f"the allocation is ending: exit code 1: {line}")
    (exp_dir / "stderr.log").write_text("srun: error: Unable to create step for job 42: Invalid generic resource\n")
    failed = backend._finish(exp, exp_dir, 1, time.monotonic(), _Supervised())
    assert failed.status is Status.FAILED  # any other refusal stays the config's failure


def test_slurm_nodes_come_from_the_allocation():
    hosts = {"node-[1-2]": ["node-1", "node-2"]}.__getitem__
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[1-2]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
           "SLURM_NTASKS_PER_NODE": "2"}
    assert slurm_nodes(True, environ=env, expand=hosts) == [Node("node-1", (0, 1)), Node("node-2", (0, 1))]
    assert slurm_nodes(True, 3, 1, environ=env, expand=hosts) == [Node("node-1", (0, 1, 2))]
    no_tasks = {k: v for k, v in env.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert slurm_nodes(True, environ=no_tasks, expand=hosts)[0].slots == tuple(range(8))
    assert slurm_nodes(False, environ={**env, "SLURM_GPUS_ON_NODE": "4"}, expand=hosts)[1] == Node("node-2",
                                                                                                 (0, 1, 2, 3))
    with pytest.raises(ConfigError, match="the allocation has no GPU"):
        slurm_nodes(False, environ=env, expand=hosts)
    with pytest.raises(ConfigError, match="--num_nodes 3: the Slurm allocation has 2 node"):
        slurm_nodes(True, num_nodes=3, environ=env, expand=hosts)
    with pytest.raises(ConfigError, match=r"inside a Slurm allocation \(salloc, or an sbatch script\): "
                                          "SLURM_JOB_NODELIST is not set"):
        slurm_nodes(True, environ={}, expand=hosts)
    starter = SlurmBackend(spec_for(cpu=True), environ=env).starter
    assert starter.cpus_per_task(Reservation((Node("node-1", (0, 1)),))) == 4


def test_a_steps_record_holds_its_stop_handle(tmp_path):
    starter = SlurmBackend(spec_for(cpu=True), environ={"SLURM_JOB_ID": "42", "SLURM_JOB_CPUS_PER_NODE": "2"}).starter
    starter._steps["tok"] = "zerotune-z1-abcd1234"
    assert starter.stop_handle("tok") == {"kind": "slurm_step", "job_id": "42", "step_name": "zerotune-z1-abcd1234"}
    assert starter.stop_handle("another") is None
    path = write_running_record(tmp_path, "z1", "tok", 29500, stop=starter.stop_handle("tok"))
    record = json.loads(path.read_text())
    assert stop_handles.record_handle(record) == step_handle("42", "zerotune-z1-abcd1234")
    # a step named by top-level keys (a format no released zerotune wrote) is no handle
    assert stop_handles.record_handle({"slurm_job": "42", "slurm_step_name": "zerotune-z1-abcd1234"}) is None
    assert not stop_handles.cancel_handle(None) and not stop_handles.cancel_handle({"kind": ["a newer zerotune's"]})
    assert not stop_handles.cancel_handle({"kind": "slurm_step", "job_id": 42})  # not a step's name: nothing cancelled


def test_the_reaper_stops_an_orphans_handle_through_its_kinds_canceller(tmp_path, monkeypatch):
    stopped = []
    monkeypatch.setitem(stop_handles.CANCELLERS, "slurm_step", lambda handle: stopped.append(dict(handle)) or True)
    for name, handle in (("new", {"stop": step_handle("42", "step-a")}),
                         ("unknown", {"slurm_job": "42", "slurm_step_name": "step-b"}), ("local", {})):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "token": "no-process-has-this-token", "master_port": None, "host": socket.gethostname(),
            "tuner_pid": 2**22 + 1, "tuner_create_time": 0.0, "leader": None, "since": None, **handle}))
    assert reap_orphans(tmp_path) == ["local", "new", "unknown"]
    assert stopped == [step_handle("42", "step-a")]  # only a stop handle names what to stop
    assert list(tmp_path.iterdir()) == []


def test_backend_slurm_outside_an_allocation_or_with_a_hostfile_is_exit_2(tmp_path, monkeypatch, capsys):
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    cfg = write_config(tmp_path / "ds.json")
    base = ["tune", "--backend", "slurm", "--num_gpus", "2", "--device-memory", "3GiB", "--cpu"]
    assert cli.main([*base, SCRIPT, "--deepspeed_config", str(cfg)]) == 2
    assert "--backend slurm runs inside a Slurm allocation" in capsys.readouterr().err
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    assert cli.main([*base, "--hostfile", str(tmp_path / "hostfile"), SCRIPT, "--deepspeed_config", str(cfg)]) == 2
    assert "--hostfile goes with the local backend" in capsys.readouterr().err


# -- on a real Slurm ---------------------------------------------------------------------------------------------

@functools.cache
def _slurm_down() -> str:
    """Why the e2e tests cannot run here ('' when a node is up); asked once."""
    if shutil.which("sinfo") is None:
        return "no Slurm here (sinfo not found); as root, .ci/slurm_up.sh starts a one-node cluster"
    try:
        run = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "Slurm is not up: sinfo did not answer in 30 s; .ci/slurm_up.sh starts it"
    if run.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in run.stdout.split()):
        return f"Slurm is not up: sinfo says {(run.stdout + run.stderr).strip()[:200]!r}; .ci/slurm_up.sh starts it"
    return ""


@pytest.fixture
def slurm():
    """Skips the test (fails it under ``ZEROTUNE_REQUIRE_SERVICES=1``), saying why, unless a Slurm cluster with a
    usable node answers here."""
    need(_slurm_down())


def steps_of(job: str) -> list[str]:
    """The job's steps in ``squeue --steps`` (``id name``), the batch and extern steps left out."""
    out = subprocess.run(["squeue", "--steps", "-h", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                         timeout=30).stdout
    return [line for line in out.splitlines() if not re.match(r"\S+\.(batch|extern) ", line)]


def job_gone(job: str, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            return True
        time.sleep(0.5)
    return False


def stage1_config(path: Path) -> Path:
    """The tiny example's config, ZeRO stage 1 only, mbs up to 2, the global batch at most 4 (no gas phase): a
    tuning of 3 runs (the profile run, mbs 2 and 1), 4 or 5 where the noise asks for a re-measurement."""
    write_config(path, max_train_micro_batch_size_per_gpu=2, max_train_batch_size=4)
    cfg = json.loads(path.read_text())
    cfg["zero_optimization"]["stage"] = 1
    path.write_text(json.dumps(cfg))
    return path


def tune_args(cfg: Path, results: Path) -> list[str]:
    return [PY, "-m", "zerotune", "tune", "--backend", "slurm", "--num_gpus", "2", "--device-memory", "3GiB",
            "--timeout", "240", "--results-dir", str(results), SCRIPT, *TINY, "--steps", "6",
            "--deepspeed_config", str(cfg)]


def records_of(results: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (results / "exps").glob("*/exp.json")}


@pytest.mark.e2e
def test_tune_inside_salloc_runs_each_experiment_as_a_step(slurm, tmp_path):
    cfg, results = stage1_config(tmp_path / "ds.json"), tmp_path / "results"
    run = subprocess.run(["salloc", "-N1", "--ntasks-per-node=2", "-J", "zerotune-test-salloc",
                          *tune_args(cfg, results)], cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    records = records_of(results)
    assert all(r["status"] == "ok" for r in records.values()), {n: r["error"] for n, r in records.items()}
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal == best_pooled(list(records.values()))["ds_config"]
    assert optimal["zero_optimization"]["stage"] == 1 and optimal["train_micro_batch_size_per_gpu"] in (1, 2)
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    for name, record in records.items():
        exp_dir = results / "exps" / name
        cmd = (exp_dir / "cmd.txt").read_text()
        assert (f" srun --nodes 1 --ntasks 2 --ntasks-per-node 2 --nodelist {host} --kill-on-bad-exit=1 --exact "
                f"--cpus-per-task 1 --job-name zerotune-{name}-") in cmd, cmd
        assert f"MASTER_ADDR={host} " in cmd and " -m zerotune.run.backends.slurm_rank " in cmd
        assert (record["launch"], record["launch_note"]) == ("warm", ""), name  # forked in the servers' step
        if record["kind"] != "profile":  # every rank's probe stream, read where the step wrote it
            assert sorted(read_streams(exp_dir)) == [0, 1], name
            assert record["metric_source"] == "probe" and record["peak_memory_bytes"] > 50 * 2**20
    assert " srun --nodes 1 --ntasks 2 " in (results / "cmd_optimal.txt").read_text()
    ports = [re.search(r"MASTER_PORT=(\d+)", (results / "exps" / n / "cmd.txt").read_text()).group(1) for n in records]
    assert [f for f in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*") if f.name.split("_")[-2] in ports] == []
    assert processes_running(str(tmp_path)) == []


@pytest.mark.e2e
def test_a_torchrun_job_is_tuned_inside_salloc_each_rank_a_torchrun_rank(slurm, tmp_path):
    cfg, results = stage1_config(tmp_path / "ds.json"), tmp_path / "results"
    script = str(ROOT / "examples" / "train_torchrun.py")  # strict argparse: no --local_rank
    run = subprocess.run(["salloc", "-N1", "--ntasks-per-node=2", "-J", "zerotune-test-torchrun", PY, "-m", "zerotune",
                          "tune", "--backend", "slurm", "--device-memory", "3GiB", "--timeout", "240", "--results-dir",
                          str(results), "--max-launches", "2", "--", "torchrun", "--nproc_per_node", "2", script,
                          *TINY, "--steps", "6", "--deepspeed_config", str(cfg)], cwd=tmp_path, env=run_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = records_of(results)
    assert len(records) == 2 and all(r["status"] == "ok" for r in records.values()), records
    for name, record in records.items():
        exp_dir = results / "exps" / name
        assert " -m zerotune.run.backends.slurm_rank --contract torchrun " in (exp_dir / "cmd.txt").read_text()
        assert (record["launch"], record["launch_note"]) == ("warm", ""), name
        assert record["kind"] == "profile" or "(rank 0 of 2, local world 2)" in (exp_dir / "stdout.log").read_text()
    assert processes_running(str(tmp_path)) == []


@pytest.fixture
def allocation(slurm, monkeypatch):
    """A 1-node, 2-task allocation held without a shell (``salloc --no-shell``), this process inside it (its
    SLURM_* variables set, as salloc sets them for its command); cancelled at the end."""
    run = subprocess.run(["salloc", "--no-shell", "-N1", "--ntasks-per-node=2", "-J", "zerotune-test-alloc"],
                         capture_output=True, text=True, timeout=120)
    match = re.search(r"Granted job allocation (\d+)", run.stderr)
    assert match, run.stderr
    job = match.group(1)
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        nodelist = re.search(r" NodeList=(\S+)", shown).group(1)
        for k, v in {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_CPUS_PER_NODE": "2",
                     "SLURM_NTASKS_PER_NODE": "2", "OMP_NUM_THREADS": "1"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("PYTHONPATH", run_env()["PYTHONPATH"])
        yield job
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        job_gone(job)


def _not_a_server(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` less the warm servers' step (its srun, and its tasks: slurmstepd's children); what the servers
    forked (launchers, ranks) has their command line and stays."""
    out = []
    for p in procs:
        try:
            if p.name() != "srun" and (p.parent() is None or p.parent().name() != "slurmstepd"):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_step_killed_by_its_timeout_leaves_no_step_and_no_rank(allocation, tmp_path, warm):
    out = tmp_path / "ranks"
    out.mkdir()
    sleeper = tmp_path / "sleeper.py"  # a rank that says what it was given, then hangs
    sleeper.write_text("import json, os, sys, time\n"
                       f"json.dump({{'argv': sys.argv[1:], 'env': {{k: os.environ.get(k) for k in ('RANK', "
                       f"'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}}}}, "
                       f"open(os.path.join({str(out)!r}, 'rank' + os.environ['RANK'] + '.json'), 'w'))\n"
                       "time.sleep(300)\n")
    cfg = write_config(tmp_path / "ds.json")
    spec = LaunchSpec(script=str(sleeper), script_args=("--deepspeed_config", str(cfg)), cpu=True,
                      device_memory_bytes=3 * 2**30, timeout_s=8, warm=warm)
    backend = SlurmBackend(spec)
    scheduler = Scheduler(backend, SlotPool(slurm_nodes(True)), tmp_path / "exps")
    exp = Experiment("hangs", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2}, num_slots=2)
    seen: list[list[str]] = []
    ended = threading.Event()  # the steps are watched for as long as the run lasts (a warm server's preload first)

    def watch_steps() -> None:
        while not ended.is_set():
            seen.append(steps_of(allocation))
            ended.wait(0.5)

    watch = threading.Thread(target=watch_steps, daemon=True)
    watch.start()
    start = time.monotonic()
    (done,) = scheduler.run([exp])
    took = time.monotonic() - start
    ended.set()
    watch.join()

    assert done.status == Status.TIMEOUT and done.error == "killed after the 8 s timeout", done.error
    assert took < 8 + 20, took
    assert any(any(" zerotune-hangs-" in line for line in lines) for lines in seen), seen  # it ran as a step
    assert done.launch == ("warm" if warm else "cold") and done.launch_note == ""
    assert [line.split()[1][:14] for line in steps_of(allocation)] == (["zerotune-warm-"] if warm else [])
    left = _not_a_server(processes_running(str(sleeper)))  # the run's ranks are gone, its server stays
    assert left == [], [(p, p.cmdline(), p.parent()) for p in left]
    backend.close()
    assert steps_of(allocation) == [] and processes_running(str(sleeper)) == []
    ranks = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    port = re.search(r"MASTER_PORT=(\d+)", (tmp_path / "exps" / "hangs" / "cmd.txt").read_text()).group(1)
    host = os.environ["SLURM_JOB_NODELIST"]
    assert ranks == {f"rank{r}.json": {"argv": [f"--local_rank={r}", "--deepspeed_config",
                                                str(tmp_path / "exps" / "hangs" / "ds_config.json")],
                                       "env": {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                               "LOCAL_SIZE": "2", "MASTER_ADDR": host, "MASTER_PORT": port}}
                     for r in (0, 1)}


@pytest.mark.e2e
def test_a_step_left_by_a_killed_tuner_is_cancelled_by_the_rerun(allocation, tmp_path):
    """A tuner SIGKILLed mid-step leaves its running record; the next tuner's reap cancels the step by the job id
    and step name its stop handle records (its ranks on other nodes have no process here to kill)."""
    name = "zerotune-orphan-abcd1234"
    srun = subprocess.Popen(["srun", "-n1", "--job-name", name, "sleep", "300"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while slurm_step_id(allocation, name) is None:
            assert time.monotonic() < deadline and srun.poll() is None, "the step never started"
            time.sleep(0.5)
        running = tmp_path / "running"
        running.mkdir()
        (running / "orphan.json").write_text(json.dumps({
            "name": "orphan", "token": "no-process-has-this-token", "master_port": 1, "host": socket.gethostname(),
            "tuner_pid": 2**22 + 1, "tuner_create_time": 0.0, "leader": None, "since": None,
            "stop": step_handle(allocation, name)}))
        assert reap_orphans(running) == ["orphan"]  # its tuner (a pid above Linux's largest) is gone
        assert slurm_step_id(allocation, name) is None and steps_of(allocation) == []
        assert srun.wait(timeout=30) != 0  # srun ends with its cancelled step
        assert list(running.iterdir()) == []
    finally:
        if srun.poll() is None:
            srun.kill()


@pytest.mark.e2e
def test_a_tuning_job_cancelled_by_scancel_resumes_to_the_answer(slurm, tmp_path):
    cfg, results = stage1_config(tmp_path / "ds.json"), tmp_path / "results"
    batch = tmp_path / "tune.sbatch"
    batch.write_text("#!/bin/bash\n#SBATCH -N1 --ntasks-per-node=2 -J zerotune-test-sbatch\n"
                     f"#SBATCH -o {tmp_path}/slurm-%j.out\n"
                     f"cd {tmp_path}\nexec {' '.join(tune_args(cfg, results))}\n")
    job = subprocess.run(["sbatch", "--parsable", str(batch)], env=run_env(), capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]
    try:  # cancel once a measured experiment has finished, while the next one runs as a step (a warm run is ~1 s)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            records = records_of(results) if (results / "exps").is_dir() else {}
            if any(r["kind"] != "profile" and r["status"] == "ok" for r in records.values()) and any(
                    " zerotune-z" in f" {line.split()[1]}" for line in steps_of(job)):
                break
            assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(), \
                (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        subprocess.run(["scancel", job], check=True)
    assert job_gone(job)
    assert processes_running(str(tmp_path)) == []
    first = {p.parent.name: p.read_text() for p in (results / "exps").glob("*/exp.json")}
    statuses = {n: json.loads(t)["status"] for n, t in first.items()}
    finished = {n for n, s in statuses.items() if s == "ok"}
    # cut short; a step the ending allocation refused is interrupted, never a failed config
    assert len(finished) >= 2 and set(statuses.values()) <= {"ok", "interrupted"}, statuses
    assert "zerotune: interrupted (SIGTERM)" in (tmp_path / f"slurm-{job}.out").read_text()

    again = subprocess.run(["sbatch", "--wait", str(batch)], env=run_env(), capture_output=True, text=True,
                           timeout=600)
    log = "\n".join(p.read_text()[-2000:] for p in tmp_path.glob("slurm-*.out"))
    assert again.returncode == 0, log
    for name in finished:  # reused, not run again
        assert (results / "exps" / name / "exp.json").read_text() == first[name], name
    records = records_of(results)
    assert all(r["status"] == "ok" for r in records.values()), {n: r["error"] for n, r in records.items()}
    summary = (results / "summary.txt").read_text()
    assert f"{len(records)} experiments ({len(records) - len(finished)} launched now)" in summary, summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal == best_pooled(list(records.values()))["ds_config"]
    assert processes_running(str(tmp_path)) == []
