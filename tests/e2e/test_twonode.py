"""Two nodes for real, on this one machine: tunings whose experiments run ranks on both nodes of the two-node
test cluster (``.ci/twonode_up.sh``: network namespaces ``zt-node0`` and ``zt-node1`` joined by a veth pair,
10.77.0.1 and 10.77.0.2, each with its own hostname, sshd and slurmd), through Slurm, DeepSpeed's own multi-node
runner (pdsh over ssh, from a hostfile) and Ray (a Ray node per namespace). The tuner runs on node 0, as it would
on a cluster's first node, with real DeepSpeed on one CPU rank per node talking gloo over the veth pair.

Each test checks that every launched experiment's two ranks recorded different addresses (the probe's exit
records), the answer, and the launch line. They skip, naming why, when the cluster is not up (not root, or
``make test`` not run). ~1 minute each.
"""
import base64
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.faults.processes import processes_running
from tests.helpers.cluster_env import run_env
from tests.helpers.services import need
from tests.helpers.tiny import SCRIPT, TINY, best_pooled, write_config
from zerotune.probe import read_exits

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ON_NODE = str(ROOT / ".ci" / "on_node")
SLURM_CONF = "/etc/zerotune-twonode/slurm.conf"
ADDRESSES = {"10.77.0.1", "10.77.0.2"}

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("cluster")]  # one Slurm, one Ray at a time


@functools.cache
def _cluster_down() -> str:
    """Why these tests cannot run here ('' when both nodes are up); asked once."""
    if not Path("/run/netns/zt-node1").exists():
        return "no two-node test cluster (network namespace zt-node1 not found); as root, .ci/twonode_up.sh makes it"
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        return "entering the two nodes' namespaces needs root and nsenter"
    try:
        run = subprocess.run([ON_NODE, "0", "sinfo", "-h", "-N", "-o", "%T"],
                             env={**os.environ, "SLURM_CONF": SLURM_CONF}, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the two-node Slurm did not answer in 30 s; .ci/twonode_up.sh starts it"
    states = run.stdout.split()
    if run.returncode != 0 or len(states) != 2 or not all(s in ("idle", "mixed", "allocated") for s in states):
        return f"the two-node Slurm is not up: sinfo says {(run.stdout + run.stderr).strip()[:200]!r}"
    return ""


@pytest.fixture
def two_nodes():
    need(_cluster_down())


def node_env(**extra: str) -> dict[str, str]:
    """What the tuner and, through srun, Ray or pdsh, the ranks get: test_slurm's environment (zerotune, this
    checkout, importable; one thread per rank) and ``extra``."""
    return {**run_env(), **extra}


def one_run_config(path: Path) -> Path:
    """ZeRO stage 1 at mbs 1 only, global batch 2: the profile run and one experiment."""
    write_config(path, max_train_micro_batch_size_per_gpu=1, max_train_batch_size=2)
    cfg = json.loads(path.read_text())
    cfg["zero_optimization"]["stage"] = 1
    path.write_text(json.dumps(cfg))
    return path


def tune(tmp_path: Path, backend_args: list[str], env: dict[str, str], prefix: list[str] = ()) -> Path:
    """``zerotune tune`` on node 0 (under ``prefix``, e.g. salloc) with one rank per node; returns the results dir."""
    cfg, results = one_run_config(tmp_path / "ds.json"), tmp_path / "results"
    run = subprocess.run([ON_NODE, "0", *prefix, PY, "-m", "zerotune", "tune", *backend_args, "--device-memory",
                          "3GiB", "--timeout", "240", "--results-dir", str(results), SCRIPT, *TINY, "--steps", "6",
                          "--deepspeed_config", str(cfg)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return results


def slurm_killed(exp_dir: Path) -> dict[int, str]:
    """rank -> node, of the tasks srun reports killed in ``exp_dir``'s stderr.log (``srun: error: ztnode1: task 1:
    Killed``)."""
    text = (exp_dir / "stderr.log").read_text(errors="replace")
    return {int(rank): node for node, rank in re.findall(r"srun: error: (\S+): task (\d+): Killed", text)}


def assert_ranks_on_both_nodes(results: Path) -> list[dict]:
    """Both experiments ran ok, and the one past the profile (which stops in its first forward, before any exit
    record) had rank 0 and rank 1 on different nodes; returns the records."""
    records = [json.loads(p.read_text()) for p in (results / "exps").glob("*/exp.json")]
    assert len(records) == 2 and all(r["status"] == "ok" for r in records), [(r["name"], r["error"]) for r in records]
    assert [r["kind"] for r in records].count("profile") == 1
    for r in records:
        if r["kind"] == "profile":
            continue
        exits = read_exits(results / "exps" / r["name"])
        hosts = {rank: e["host"] for rank, e in exits.items()}
        if sorted(exits) != [0, 1] and r["ended"] == "step_cap":  # Slurm's cancel at the cap can kill a rank before
            # its exit hooks run: srun then names the node of each task it killed
            hosts.update(slurm_killed(results / "exps" / r["name"]))
        else:
            assert {e["address"] for e in exits.values()} == ADDRESSES, (r["name"], exits)
        assert sorted(hosts) == [0, 1] and set(hosts.values()) == {"ztnode0", "ztnode1"}, (r["name"], exits)
    best = best_pooled(records)
    assert json.loads((results / "ds_config_optimal.json").read_text()) == best["ds_config"]
    return records


def test_slurm_steps_run_a_rank_on_each_node(two_nodes, tmp_path):
    env = node_env(SLURM_CONF=SLURM_CONF)
    results = tune(tmp_path, ["--backend", "slurm", "--num_gpus", "1"], env,
                   prefix=["salloc", "-N2", "--ntasks-per-node=1", "-J", "zerotune-test-twonode"])
    records = assert_ranks_on_both_nodes(results)
    for r in records:
        cmd = (results / "exps" / r["name"] / "cmd.txt").read_text()
        assert "MASTER_ADDR=ztnode0 " in cmd and " srun --nodes 2 --ntasks 2 --ntasks-per-node 1 --nodelist " \
            "ztnode0,ztnode1 " in cmd, cmd
        # forked by each node's warm server (the nodes share /tmp: their sockets are apart by node name)
        assert (r["launch"], r["launch_note"]) == ("warm", ""), r["name"]


def test_a_hostfile_runs_deepspeeds_multi_node_runner_over_ssh(two_nodes, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("ztnode0 slots=1\nztnode1 slots=1\n")
    results = tune(tmp_path, ["--hostfile", str(hostfile), "--cpu"], node_env())
    records = assert_ranks_on_both_nodes(results)
    for r in records:
        exp_dir = results / "exps" / r["name"]
        cmd = (exp_dir / "cmd.txt").read_text()
        assert f" --hostfile {hostfile} --force_multi --include ztnode0:0@ztnode1:0 " in cmd, cmd
        # DS_ACCELERATOR reaches node 1's rank only through the runner's env file (zerotune.deepspeed.rank_env)
        assert "DS_ACCELERATOR=cpu" in (exp_dir / "deepspeed_env").read_text().splitlines()
    assert (results / "cmd_optimal.txt").read_text().count("--include ztnode0:0@ztnode1:0") == 1


@pytest.fixture
def ray_two_nodes(two_nodes, tmp_path):
    """A Ray head on node 0 and a worker on node 1, one CPU and one logical GPU each, token authentication on
    (Ray's default once a token exists) with a token of the test's own; yields the tuner's environment."""
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    env = node_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
                   RAY_memory_monitor_refresh_ms="0", RAY_ADDRESS="10.77.0.1:6390")
    ray = [str(Path(PY).with_name("ray"))]
    common = ["--num-cpus", "1", "--num-gpus", "1", "--object-store-memory", str(100 * 2**20),
              "--disable-usage-stats"]
    temps = [tempfile.mkdtemp(prefix=f"zt-ray{node}-", dir="/tmp") for node in (0, 1)]  # socket paths <= 107 bytes
    try:
        for node, args in ((0, ["--head", "--port", "6390", "--include-dashboard", "false"]),
                           (1, ["--address", "10.77.0.1:6390"])):
            subprocess.run([ON_NODE, str(node), *ray, "start", *args, "--node-ip-address", f"10.77.0.{node + 1}",
                            "--temp-dir", temps[node], *common], env=env, check=True, capture_output=True, timeout=120)
        yield env
    finally:
        subprocess.run([ON_NODE, "0", *ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)


def test_ray_places_an_experiment_on_both_ray_nodes(ray_two_nodes, tmp_path):
    hostfile = tmp_path / "hostfile"  # the slots' shape; Ray decides where they run
    hostfile.write_text("ztnode0 slots=1\nztnode1 slots=1\n")
    results = tune(tmp_path, ["--backend", "ray", "--address", "10.77.0.1:6390", "--hostfile", str(hostfile),
                              "--cpu"], ray_two_nodes)
    records = assert_ranks_on_both_nodes(results)
    for r in records:
        exp_dir = results / "exps" / r["name"]
        # Ray's grant, by node address, in the experiment's own hostfile for DeepSpeed's multi-node runner
        assert sorted((exp_dir / "hostfile").read_text().splitlines()) == ["10.77.0.1 slots=1", "10.77.0.2 slots=1"]
        assert f" --hostfile {exp_dir / 'hostfile'} --force_multi " in (exp_dir / "cmd.txt").read_text()


DRIVER = """
import json, sys
from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

hostfile, sleeper, cfg, exps = sys.argv[1:5]
spec = LaunchSpec(script=sleeper, script_args=("--deepspeed_config", cfg), cpu=True, hostfile=hostfile,
                  device_memory_bytes=3 * 2**30, timeout_s=30)
exp = Experiment("hangs", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2}, num_nodes=2, num_slots=1)
(done,) = Scheduler(LocalBackend(spec), SlotPool(select_resources(hostfile)), exps).run([exp])
print(json.dumps({"status": done.status.value, "error": done.error}))
"""


def test_a_stopped_multi_node_run_leaves_other_deepspeed_launchers_alone(two_nodes, tmp_path):
    """The multi-node runner's own stop runs ``pkill -f "python -u -m deepspeed.launcher.launch"`` on every host,
    which would kill every DeepSpeed launcher there; zerotune stops the run by its token on each node instead. A
    bystander launcher on node 0 (another experiment's, as the direct launch starts it) outlives the stop."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    sleeper = tmp_path / "sleeper.py"  # each rank notes its node, then hangs
    sleeper.write_text("import os, socket, time\n"
                       f"open(os.path.join({str(ranks)!r}, socket.gethostname()), 'w').close()\n"
                       "time.sleep(300)\n")
    bystander = tmp_path / "bystander" / "sleeper.py"
    bystander.parent.mkdir()
    bystander.write_text("import time\ntime.sleep(300)\n")
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0]}).encode()).decode()
    other = subprocess.Popen([ON_NODE, "0", PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info", world,
                              "--master_addr", "127.0.0.1", "--master_port", "29731", str(bystander)],
                             env=node_env(DS_ACCELERATOR="cpu", LOCAL_SIZE="1"), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (tmp_path / "driver.py").write_text(DRIVER)
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("ztnode0 slots=1\nztnode1 slots=1\n")
        run = subprocess.run([ON_NODE, "0", PY, str(tmp_path / "driver.py"), str(hostfile), str(sleeper),
                              str(write_config(tmp_path / "ds.json")), str(tmp_path / "exps")],
                             cwd=tmp_path, env=node_env(), capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout.splitlines()[-1]) == {"status": "timeout",
                                                            "error": "killed after the 30 s timeout"}
        assert sorted(p.name for p in ranks.iterdir()) == ["ztnode0", "ztnode1"]  # it ran on both nodes
        assert processes_running(str(sleeper)) == []  # and nothing of it is left on either
        assert other.poll() is None and len(processes_running(str(bystander))) == 2  # launcher and rank
    finally:
        os.killpg(other.pid, 9)
        other.wait()
