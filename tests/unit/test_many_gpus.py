"""Many GPUs per node, with stand-ins (no GPU here): the exact devices, commands and environments each
experiment gets on an 8-GPU node with --include/--exclude, under CUDA_VISIBLE_DEVICES, on two nodes with
different slot counts; the communication settings passed to every rank by every backend; a run's peak the
largest of its ranks' (docs/clusters.md, "Many GPUs per node"; docs/decisions.md, D300)."""
import base64
import json
import os
import subprocess
import sys

import pytest

from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation, RunLaunch
from zerotune.core.objective import OBJECTIVES
from zerotune.deepspeed.launcher import launch_command, launch_env
from zerotune.deepspeed.rank_env import passed_env, runner_env_file
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV, PROBE_PATH
from zerotune.run import expdir
from zerotune.run.backends.local import LocalBackend
from zerotune.run.backends.ray import node_spec
from zerotune.run.backends.slurm import srun_command, step_env
from zerotune.run.resources import select_resources
from zerotune.run.slots import SlotPool
from zerotune.strategy.answer import Capacity, capacity, memory_fraction

PY = sys.executable
GIB = 2**30
COMM = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "eth1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "FI_PROVIDER": "efa"}


@pytest.fixture
def clean_env(monkeypatch):
    """No communication setting, CUDA_VISIBLE_DEVICES or DeepSpeed env file inherited from the machine."""
    for name in list(os.environ):
        if name.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_")) or name in (
                "CUDA_VISIBLE_DEVICES", "DS_ENV_FILE"):
            monkeypatch.delenv(name)
    return monkeypatch


def cuda_spec(**kw) -> LaunchSpec:
    return LaunchSpec(script="train.py", script_args=("--deepspeed_config", "ds.json"), **kw)


def world(cmd: list[str]) -> dict:
    return json.loads(base64.urlsafe_b64decode(cmd[cmd.index("--world_info") + 1]))


# -- which devices: --include/--exclude and CUDA_VISIBLE_DEVICES ---------------------------------------------------

def test_an_8_gpu_node_with_include_gives_each_experiment_its_own_devices_by_physical_id(clean_env, tmp_path):
    nodes = select_resources(include="localhost:1,2,5,6", local_slots=8)
    assert nodes == [Node("localhost", (1, 2, 5, 6))]
    pool = SlotPool(nodes)
    first, second = pool.try_reserve(1, 2), pool.try_reserve(1, 2)
    assert (first.include_arg(), second.include_arg(), pool.try_reserve(1, 1)) == ("localhost:1,2", "localhost:5,6",
                                                                                   None)
    spec = cuda_spec(device_memory_bytes=80 * GIB)
    # the experiment's launch: DeepSpeed's node launcher given exactly these ids, which it puts into each of its
    # ranks' CUDA_VISIBLE_DEVICES; no CPU variables, and the probe caps each device at the per-device budget
    cmd = launch_command(spec, second, "/exps/e/ds_config.json", 29600, direct=True)
    assert cmd == [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info", cmd[5], "--master_addr", "127.0.0.1",
                   "--master_port", "29600", "train.py", "--deepspeed_config", "/exps/e/ds_config.json"]
    assert world(cmd) == {"localhost": [5, 6]}
    exp_dir = tmp_path / "exps" / "z1_mbs4"
    inherited = os.environ.get("PYTHONPATH", "")
    assert launch_env(spec, second, probe_dir=exp_dir) == {
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROBE_PATH), inherited) if p),
        PROBE_DIR_ENV: str(exp_dir.resolve()), BUDGET_ENV: str(80 * GIB)}
    # the command to paste goes through the runner, which reads --include as physical ids too
    assert launch_command(spec, second, "/r/ds_config_optimal.json", 29500)[1:5] == [
        "--include", "localhost:5,6", "--master_port", "29500"]


def test_an_8_gpu_node_with_exclude(clean_env):
    nodes = select_resources(exclude="localhost:0,7", local_slots=8)
    assert nodes == [Node("localhost", (1, 2, 3, 4, 5, 6))]
    pool = SlotPool(nodes)
    assert (pool.capacity(1, 2), pool.capacity(1, 4), pool.capacity(1, 8)) == (3, 1, 0)
    assert [pool.try_reserve(1, 4).include_arg(), pool.try_reserve(1, 2).include_arg()] == [
        "localhost:1,2,3,4", "localhost:5,6"]


def test_cuda_visible_devices_are_the_local_slots_and_include_picks_among_them(clean_env):
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert select_resources() == [Node("localhost", (2, 3, 5))]
    assert select_resources(include="localhost:3,5") == [Node("localhost", (3, 5))]
    assert select_resources(exclude="localhost:3") == [Node("localhost", (2, 5))]
    assert select_resources(num_gpus=2) == [Node("localhost", (2, 3))]  # the first visible, not devices 0 and 1
    with pytest.raises(ConfigError) as err:
        select_resources(include="localhost:1,3")
    assert str(err.value) == ("--include 'localhost:1,3': host 'localhost' has no slot 1 (its slots: 2,3,5, "
                              "from CUDA_VISIBLE_DEVICES=2,3,5)")
    with pytest.raises(ConfigError) as err:
        select_resources(num_gpus=4)
    assert str(err.value) == ("--num_gpus 4 but host 'localhost' has 3 slot(s) (no hostfile (localhost only), "
                              "from CUDA_VISIBLE_DEVICES=2,3,5)")


def test_deepspeeds_node_launcher_sets_the_ranks_visible_devices_from_the_experiments_ids():
    """What DeepSpeed's node launcher does with an experiment's ids (``launch.py`` calls the accelerator's
    ``set_visible_devices_envs`` with its node's list of the world info): the physical ids, over the tuner's
    ``CUDA_VISIBLE_DEVICES``; each rank then takes the ``LOCAL_RANK``-th of them."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    env = {"CUDA_VISIBLE_DEVICES": "2,3,5"}
    CUDA_Accelerator.__new__(CUDA_Accelerator).set_visible_devices_envs(env, [3, 5])  # no CUDA needed to build
    assert env == {"CUDA_VISIBLE_DEVICES": "3,5"}


def test_include_naming_a_hidden_device_is_exit_2_naming_it(clean_env, tmp_path, capsys):
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    clean_env.setattr(cli, "cuda_available", lambda: True)
    code = cli.main(["tune", "--include", "localhost:4", str(tmp_path / "train.py"), "--deepspeed_config",
                     str(tmp_path / "ds.json")])
    assert code == 2
    assert capsys.readouterr().err == ("zerotune: error: --include 'localhost:4': host 'localhost' has no slot 4 "
                                       "(its slots: 2,3,5, from CUDA_VISIBLE_DEVICES=2,3,5)\n")


def test_two_nodes_with_different_slot_counts_get_the_exact_per_node_include(clean_env, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=4\n")
    nodes = select_resources(hostfile, include="worker-0:4,5,6,7@worker-1:1,3")
    assert nodes == [Node("worker-0", (4, 5, 6, 7)), Node("worker-1", (1, 3))]
    pool = SlotPool(nodes)
    assert (pool.capacity(2, 2), pool.capacity(1, 4), pool.capacity(2, 3)) == (1, 1, 0)
    both = pool.try_reserve(2, 2)
    assert both.include_arg() == "worker-0:4,5@worker-1:1,3" and pool.try_reserve(2, 1) is None
    assert pool.try_reserve(1, 2).include_arg() == "worker-0:6,7"
    spec = cuda_spec(hostfile=str(hostfile))
    cmd = launch_command(spec, both, "/exps/e/ds_config.json", 29601, direct=True)
    assert cmd[1:] == ["--hostfile", str(hostfile), "--force_multi", "--include", "worker-0:4,5@worker-1:1,3",
                       "--master_port", "29601", "train.py", "--deepspeed_config", "/exps/e/ds_config.json"]


# -- the communication settings reach every rank -------------------------------------------------------------------

def test_the_passed_variables_are_named_by_prefix(clean_env):
    environ = {**COMM, "UCX_TLS": "rc", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCLX": "no", "MY_NCCL_X": "no",
               "TORCH_HOME": "/t", "HOME": "/h"}
    assert passed_env(environ) == {"FI_PROVIDER": "efa", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_DEBUG": "INFO",
                                   "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "ib0",
                                   "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                   "UCX_TLS": "rc"}


def test_one_node_launch_env_carries_the_settings_and_extra_env_wins(clean_env):
    for name, value in COMM.items():
        clean_env.setenv(name, value)
    one = Reservation((Node("localhost", (0, 1, 2, 3, 4, 5, 6, 7)),))
    spec = cuda_spec(extra_env={"NCCL_DEBUG": "WARN"})
    assert launch_env(spec, one) == {**COMM, "NCCL_DEBUG": "WARN"}


def test_a_multi_node_run_writes_the_runners_env_file_for_the_other_nodes(clean_env, tmp_path):
    for name, value in COMM.items():
        clean_env.setenv(name, value)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    clean_env.setenv("HOME", str(home))
    clean_env.chdir(work)
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=TRACE\nOMP_NUM_THREADS=4")  # the user's: read last, wins
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=4\n")
    both = Reservation((Node("worker-0", (0, 1, 2, 3)), Node("worker-1", (0, 1, 2, 3))))
    exp_dir = tmp_path / "exps" / "z2_mbs1"
    exp_dir.mkdir(parents=True)
    backend = LocalBackend(LaunchSpec("train.py", ("--deepspeed_config", "ds.json"), cpu=True, hostfile=str(hostfile)))
    env, cmd = backend.starter.command(RunLaunch("z2_mbs1", both, exp_dir, str(exp_dir / "ds_config.json"), 29602,
                                                 "token"))
    assert env["DS_ENV_FILE"] == str(exp_dir / "deepspeed_env") and "--force_multi" in cmd
    # every launch variable but PYTHON* (which the runner forwards itself), in launch_env's order, the run's token
    # (the other nodes' processes are stopped by it), then the user's
    assert (exp_dir / "deepspeed_env").read_text() == (
        "FI_PROVIDER=efa\nGLOO_SOCKET_IFNAME=eth1\nNCCL_DEBUG=INFO\nNCCL_IB_HCA=mlx5_0,mlx5_1\n"
        "NCCL_SOCKET_IFNAME=ib0\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\nDS_ACCELERATOR=cpu\nLOCAL_SIZE=4\n"
        "ZEROTUNE_RUN_TOKEN=token\nNCCL_DEBUG=TRACE\nOMP_NUM_THREADS=4\n")
    assert backend.starter._remote == {"token": ["worker-0", "worker-1"]}
    one = Reservation((Node("localhost", (0, 1)),))
    env, _ = backend.starter.command(RunLaunch("z2_mbs2", one, exp_dir, "c.json", 29603, "token"))
    assert "DS_ENV_FILE" not in env  # one node: the launcher's own environment reaches its ranks


def test_a_value_with_a_line_break_is_left_out_of_the_env_file(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path))
    named = runner_env_file({"NCCL_DEBUG": "INFO", "GLOO_X": "a\nb", "PYTHONPATH": "/p"}, tmp_path / "f", {},
                            cwd=tmp_path)
    assert named == {"DS_ENV_FILE": str(tmp_path / "f")} and (tmp_path / "f").read_text() == "NCCL_DEBUG=INFO\n"


def test_deepspeeds_runner_exports_the_env_file_to_every_node(clean_env, tmp_path):
    """The real ``deepspeed`` runner, with stand-in ``ssh`` and ``pdsh`` on PATH (the stand-in pdsh records the
    command it would run on every node): the launch's variables reach the other nodes' command line."""
    for name, value in COMM.items():
        clean_env.setenv(name, value)
    clean_env.setenv("HOME", str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\necho 10.9.8.7\n")
    (bin_dir / "pdsh").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'pdsh.args'}\n")
    for tool in ("ssh", "pdsh"):
        (bin_dir / tool).chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=4\n")
    both = Reservation((Node("worker-0", (6, 7)), Node("worker-1", (2, 3))))
    spec = LaunchSpec("train.py", ("--deepspeed_config", "ds.json"), cpu=True, hostfile=str(hostfile))
    env = launch_env(spec, both)
    env.update(runner_env_file(env, tmp_path / "deepspeed_env", cwd=tmp_path))
    cmd = launch_command(spec, both, str(tmp_path / "ds.json"), 29604)
    done = subprocess.run(cmd, env={**os.environ, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    args = (tmp_path / "pdsh.args").read_text().splitlines()
    assert args[args.index("-w") + 1] == "worker-0,worker-1"
    remote = " ".join(args[args.index("-w") + 2:])
    for name, value in {**COMM, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "8"}.items():
        assert f"export {name}={value};" in remote
    assert json.loads(base64.urlsafe_b64decode(remote.split("--world_info=")[1].split()[0])) == {
        "worker-0": [6, 7], "worker-1": [2, 3]}


def test_srun_passes_the_settings_to_every_task_and_binds_no_gpu_per_task(clean_env):
    for name, value in COMM.items():
        clean_env.setenv(name, value)
    eight = Reservation((Node("gpu-1", tuple(range(8))), Node("gpu-2", tuple(range(8)))))
    spec = LaunchSpec("train.py", ("--deepspeed_config", "ds.json"), device_memory_bytes=80 * GIB)
    assert step_env(spec, eight, 29605) == {**COMM, "MASTER_ADDR": "gpu-1", "MASTER_PORT": "29605"}
    assert srun_command(spec, eight, "/exps/e/ds_config.json", 12, "zerotune-e-1") == [
        "srun", "--nodes", "2", "--ntasks", "16", "--ntasks-per-node", "8", "--nodelist", "gpu-1,gpu-2",
        "--kill-on-bad-exit=1", "--exact", "--cpus-per-task", "12", "--gpus-per-node", "8", "--gpu-bind=none",
        "--job-name", "zerotune-e-1", "--export=ALL", PY, "-u", "-m", "zerotune.run.backends.slurm_rank",
        "train.py", "--deepspeed_config", "/exps/e/ds_config.json"]


def test_ray_ships_the_tuners_settings_to_the_node_whose_own_environment_lacks_them(clean_env):
    spec = cuda_spec(extra_env={"NCCL_DEBUG": "WARN"})
    shipped = node_spec(spec, {**COMM, "HOME": "/h"})
    assert shipped.extra_env == {**COMM, "NCCL_DEBUG": "WARN"} and spec.extra_env == {"NCCL_DEBUG": "WARN"}
    # on the node (the actor's environment has none of them): the launch still carries the tuner's
    clean_env.setenv("NCCL_SOCKET_IFNAME", "lo")  # the node's own, overridden by the tuner's
    node = Reservation((Node("localhost", (2, 3)),))
    assert launch_env(shipped, node) == {**COMM, "NCCL_DEBUG": "WARN"}


# -- a run's peak is its largest rank's --------------------------------------------------------------------------

def test_the_peak_of_a_two_node_run_is_its_largest_ranks_against_the_per_device_budget(tmp_path):
    """Ranks 0-1 on one node, 2-3 on the other (the probe names each stream by global rank); rank 3's device
    peaked highest. The run's peak is rank 3's, and against the 80 GiB budget it ran near the capacity though
    rank 0 (the profile's only figure on CUDA) was calm."""
    (tmp_path / "metrics.json").write_text(json.dumps({"throughput": 100.0}))
    peaks = {0: 60 * GIB, 1: 61 * GIB, 2: 70 * GIB, 3: 74 * GIB}
    for rank, peak in peaks.items():
        lines = [{"rank": rank, "step": i, "t": 10.0 + i, "step_s": 0.1, "micro_steps": 1, "train_batch_size": 32,
                  "peak_bytes": peak - 5 * GIB, "device_peak_bytes": peak - (4 - i) * GIB} for i in range(1, 5)]
        (tmp_path / f"probe.rank{rank}.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    exp = Experiment("z2_mbs8", {"train_micro_batch_size_per_gpu": 8}, num_nodes=2, num_slots=2)

    done = expdir.finish(exp, tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.status is Status.OK and done.peak_memory_bytes == 74 * GIB
    assert memory_fraction(done.peak_memory_bytes, 80 * GIB) == 74 / 80
    assert capacity(memory_fraction(done.peak_memory_bytes, 80 * GIB)) is Capacity.NEAR
    assert capacity(memory_fraction(peaks[0], 80 * GIB)) is Capacity.CALM
