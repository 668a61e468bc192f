"""The Ray backend on a real Ray runtime started on loopback with 2 logical GPUs (CPU ranks underneath).

The tests marked e2e start Ray once for the module (``ray.init`` in this process, bound to
127.0.0.1) and are skipped when Ray is not installed (``pip install 'zerotune[ray]'``; ``make setup``
installs it). The missing-Ray error is checked without Ray, in the fast suite.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.faults.processes import processes_running
from tests.helpers.tiny import SCRIPT, TINY, write_config  # the same tiny example as the local e2e tests
from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.core.measure import measure
from zerotune.core.objective import OBJECTIVES
from zerotune.probe import read_streams
from zerotune.run.backends.ray import RayBackend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

# Ray on loopback only (it otherwise replaces 127.0.0.1 by the machine's routable address), no
# usage report, and no Ray out-of-memory killer: it kills workers when the whole machine is above
# 95% memory, which on a shared test machine says nothing about the experiment.
pytestmark = pytest.mark.xdist_group("cluster")  # one worker for the Slurm and Ray tests: one cluster each
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_memory_monitor_refresh_ms": "0", "OMP_NUM_THREADS": "1"}


REAPER_LINE = "(groups.add if line[0]"  # in the command line of a NodeLauncher's reaper process


def tiny_spec(cfg: Path, script: str = SCRIPT, **kw) -> LaunchSpec:
    return LaunchSpec(script=script, script_args=tuple(TINY + ["--steps", "6", "--deepspeed_config", str(cfg)]),
                      cpu=True, device_memory_bytes=3 * 2**30, start_profile_step=2, end_profile_step=3, **kw)


def zerotune_groups(ray) -> dict[str, dict]:
    """Ray's placement groups that zerotune made (named ``zerotune-<experiment>-<id>``), by name."""
    return {pg["name"]: pg for pg in ray.util.placement_group_table().values() if pg["name"].startswith("zerotune-")}


# -- without Ray ----------------------------------------------------------------------------------

def test_backend_ray_without_ray_installed_is_exit_2_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    cfg = write_config(tmp_path / "ds.json")
    with pytest.raises(ConfigError, match=r"pip install 'zerotune\[ray\]'"):
        RayBackend(tiny_spec(cfg))
    code = cli.main(["tune", "--backend", "ray", "--num_gpus", "2", "--device-memory", "3GiB",
                     "--results-dir", str(tmp_path / "res"), SCRIPT, "--deepspeed_config", str(cfg)])
    assert code == 2
    assert "--backend ray needs Ray" in capsys.readouterr().err
    assert not (tmp_path / "res" / "exps").exists()  # nothing was launched


def test_a_dry_run_with_backend_ray_does_not_import_ray(tmp_path):
    # importing Ray reads its environment once per process: a dry run that imported it (tests/hostile/test_fuzz.py draws
    # --backend ray) made this module's Ray head start on the machine's network address instead of 127.0.0.1
    cfg = write_config(tmp_path / "ds.json")
    code = ("import sys; from zerotune import cli; "
            f"code = cli.main(['tune', '--dry-run', '--backend', 'ray', '--num_gpus', '2', '--device-memory', '3GiB', "
            f"'--results-dir', {str(tmp_path / 'res')!r}, {SCRIPT!r}, '--deepspeed_config', {str(cfg)!r}]); "
            "print(code, 'ray' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split()[-2:] == ["0", "False"], run.stderr[-3000:]


def test_address_without_backend_ray_is_exit_2(tmp_path, capsys):
    cfg = write_config(tmp_path / "ds.json")
    code = cli.main(["tune", "--address", "127.0.0.1:6379", "--num_gpus", "2", "--device-memory", "3GiB", SCRIPT,
                     "--deepspeed_config", str(cfg)])
    assert code == 2
    assert "goes with --backend ray" in capsys.readouterr().err


@pytest.mark.e2e  # runs the real deepspeed launcher (not Ray): a few seconds
def test_multi_node_launch_names_the_granted_nodes_in_a_hostfile(tmp_path, monkeypatch):
    """What the actor of a 2-node experiment launches, outside Ray: the nodes and GPU ids Ray
    granted (faked here: loopback addresses) go into ``exp_dir/hostfile`` and ``--include`` for the
    launcher's own multi-node runner. With no ssh to those hosts the launcher fails, as it would."""
    import zerotune.run.backends._ray_node as ray_backend

    monkeypatch.setattr(ray_backend, "_granted_slots", lambda: ("127.0.0.2", [0, 1]))
    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    (exp_dir / ray_backend.DISPATCH_MARKER).write_text("token")
    launcher = ray_backend.NodeLauncher(tiny_spec(write_config(tmp_path / "ds.json"), timeout_s=120))
    exp = Experiment("two_nodes", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4}, num_nodes=2,
                     num_slots=2)
    done = launcher.run(exp, str(exp_dir), "token", str(tmp_path), [("127.0.0.3", [1, 2])])

    assert (exp_dir / "hostfile").read_text() == "127.0.0.2 slots=2\n127.0.0.3 slots=3\n"
    cmd = (exp_dir / "cmd.txt").read_text()
    assert f"--hostfile {exp_dir / 'hostfile'} --force_multi --include 127.0.0.2:0,1@127.0.0.3:1,2 " in cmd
    # the other node's ranks get the launch's environment from the runner's env file (zerotune.deepspeed.rank_env)
    assert cmd.startswith(f"DS_ACCELERATOR=cpu DS_ENV_FILE={exp_dir / 'deepspeed_env'} LOCAL_SIZE=3 ")
    # (no mimalloc arena under the CPU ranks' budget: zerotune.deepspeed.launcher.MIMALLOC_RESERVE_ENV)
    assert (exp_dir / "deepspeed_env").read_text().startswith("MIMALLOC_ARENA_RESERVE=0\nDS_ACCELERATOR=cpu\nLOCAL_SIZE=3\n")
    assert done.status == Status.FAILED and done.exit_code not in (None, 0)
    assert processes_running(str(tmp_path)) == []


def test_a_node_that_cannot_see_the_experiment_dir_fails_it(tmp_path):
    from zerotune.run.backends._ray_node import NodeLauncher

    launcher = NodeLauncher(tiny_spec(write_config(tmp_path / "ds.json")))
    exp = Experiment("elsewhere", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2}, num_slots=2)
    (tmp_path / "exp").mkdir()  # no dispatch marker: what a node without the shared filesystem sees
    done = launcher.run(exp, str(tmp_path / "exp"), "token", str(tmp_path), [])
    assert done.status == Status.FAILED
    assert f"cannot see the experiment directory {tmp_path / 'exp'}" in done.error
    assert not (tmp_path / "exp" / "cmd.txt").exists()  # nothing was launched


# -- on a real Ray runtime --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray head on 127.0.0.1 with 2 CPUs and 2 logical GPUs; yields its address (``host:port``).

    Started from this process so ``ray.shutdown`` stops exactly what it started. The environment
    (loopback, one OMP thread per rank) is set before the start: Ray's workers, and so the
    launchers and ranks they start, inherit it, as do the zerotune processes the tests start.
    """
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)  # before Ray is imported: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER then
    temp_dir = tempfile.mkdtemp(prefix="zt-ray-")  # short: Ray's socket paths must fit 107 bytes
    ray = None
    try:
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=100 * 2**20, _temp_dir=temp_dir, log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        if ray is not None:
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.e2e
def test_experiment_runs_in_a_placement_group_and_leaves_nothing(ray_cluster, tmp_path):
    import ray

    cfg = write_config(tmp_path / "ds.json")
    backend = RayBackend(tiny_spec(cfg, timeout_s=300), address=ray_cluster)
    pool = SlotPool(select_resources(local_slots=2))
    scheduler = Scheduler(backend, pool, tmp_path / "exps")
    exp = Experiment("z1_mbs2_gas1", {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4,
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                      "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}},
                     num_slots=2)
    (done,) = scheduler.run([exp])

    exp_dir = tmp_path / "exps" / exp.name
    assert done.status == Status.OK, (done.error, (exp_dir / "stderr.log").read_text()[-2000:])
    metrics = json.loads((exp_dir / "metrics.json").read_text())  # DeepSpeed's, kept for comparison
    # the metric is the step probe's, from every rank's stream written on the node
    measured = measure(read_streams(exp_dir), OBJECTIVES["throughput"])
    assert metrics["throughput"] > 0 and done.metric_source == "probe" and done.metric == measured.value
    assert sorted(read_streams(exp_dir)) == [0, 1]
    assert done.peak_memory_bytes and done.peak_memory_bytes > 50 * 2**20  # measured on the node, per rank
    record = json.loads((exp_dir / "exp.json").read_text())
    assert record["status"] == "ok" and record["metric"] == done.metric
    assert (record["launch"], record["launch_note"]) == ("warm", "")  # forked by the node's warm server
    backend.close()
    # The launcher ran on the GPUs Ray granted the bundle: DeepSpeed's node launcher, given the node's
    # world ({"localhost": [0, 1]}), sets the ranks' visible devices over the CUDA_VISIBLE_DEVICES Ray set
    cmd = (exp_dir / "cmd.txt").read_text()
    assert cmd.startswith("DS_ACCELERATOR=cpu LOCAL_SIZE=2 ") and " -m deepspeed.launcher.launch --world_info " in cmd
    assert json.loads(base64.urlsafe_b64decode(cmd.split("--world_info ")[1].split()[0])) == {"localhost": [0, 1]}
    assert not (exp_dir / ".zerotune_dispatch").exists()

    (group,) = [g for name, g in zerotune_groups(ray).items() if name.startswith(f"zerotune-{exp.name}-")]
    assert group["bundles"] == {0: {"GPU": 2.0, "CPU": 1.0}} and group["strategy"] == "STRICT_PACK"
    assert group["state"] == "REMOVED"
    deadline = time.monotonic() + 10  # Ray's view of free resources follows the removal shortly
    while ray.available_resources().get("GPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 2.0
    assert processes_running(str(tmp_path)) == []
    deadline = time.monotonic() + 10  # the node's reaper exits once the actor is gone
    while processes_running(REAPER_LINE) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_running(REAPER_LINE) == []
    assert pool.free_slots == 2


def _forked(path: str) -> list[psutil.Process]:
    """The processes a warm server for script ``path`` forked (runs' launchers and ranks: they carry its command
    line), not the server itself."""
    found = []
    for p in processes_running(path):
        try:
            if any("zerotune.run.warm.server" in " ".join(q.cmdline()) for q in p.parents()[:2]):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("stop", ["cancel_all", "ray_kills_the_actor"])
def test_a_stopped_experiment_leaves_no_launcher_on_the_node(ray_cluster, tmp_path, stop, warm):
    """Ctrl-C (``cancel_all``) records the run as interrupted; Ray killing the actor under it (its
    OOM killer, a crash) fails it; either way the launcher and its ranks are gone (warm: the node's server
    stays, for the tuning's next run, until the backend closes)."""
    import ray

    sleeper = tmp_path / "sleeper.py"  # a "training script" that never finishes
    sleeper.write_text("import time\ntime.sleep(300)\n")
    cfg = write_config(tmp_path / "ds.json")
    backend = RayBackend(tiny_spec(cfg, script=str(sleeper), timeout_s=120, warm=warm), address=ray_cluster)
    exp = Experiment(f"stopped_by_{stop}_{'warm' if warm else 'cold'}",
                     {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2}, num_slots=2)
    reservation = Reservation((Node("localhost", (0, 1)),))
    thread = threading.Thread(target=backend.run, args=(exp, reservation, tmp_path / "exp"))
    thread.start()
    deadline = time.monotonic() + 120

    def ranks() -> list[psutil.Process]:
        return [p for p in processes_running(str(sleeper)) if "--local_rank" in " ".join(p.cmdline())]

    while len(_forked(str(sleeper)) if warm else ranks()) < (3 if warm else 2):  # warm: the launcher and 2 ranks
        assert time.monotonic() < deadline and thread.is_alive(), (exp.status, exp.error)
        time.sleep(0.5)
    if stop == "cancel_all":
        backend.cancel_all()
    else:
        ray.kill(backend._running[exp.name])
    thread.join(timeout=60)

    assert not thread.is_alive()
    if stop == "cancel_all":
        assert exp.status == Status.INTERRUPTED and exp.error == "the tuner was interrupted"
    else:
        assert exp.status == Status.FAILED and exp.error.startswith("Ray error: ActorDiedError")
    assert exp.metric is None
    deadline = time.monotonic() + 20  # the reaper: TERM, then KILL after 10 s
    while (_forked(str(sleeper)) if warm else processes_running(str(sleeper))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (_forked(str(sleeper)) if warm else processes_running(str(sleeper))) == []  # launcher and both ranks
    if stop == "cancel_all":  # (an actor Ray killed returns no record of how it launched)
        assert exp.launch == ("warm" if warm else "cold")
    backend.close()
    assert processes_running(str(sleeper)) == []  # the warm server too
    (group,) = [g for n, g in zerotune_groups(ray).items() if n.startswith(f"zerotune-{exp.name}-")]
    assert group["state"] == "REMOVED"


@pytest.mark.e2e
def test_request_no_node_can_hold_fails_at_once_naming_the_gpus(ray_cluster, tmp_path):
    import ray

    backend = RayBackend(tiny_spec(write_config(tmp_path / "ds.json"), timeout_s=300), address=ray_cluster)
    exp = Experiment("too_big", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 3}, num_slots=3)
    start = time.monotonic()
    backend.run(exp, Reservation((Node("localhost", (0, 1, 2)),)), tmp_path / "exp")
    assert time.monotonic() - start < 10
    assert exp.status == Status.FAILED
    assert "needs 1 node(s) with 3 GPU(s) and 1 CPU each, the cluster has 0 (127.0.0.1: GPU=2 CPU=2)" in exp.error
    assert not any(n.startswith(f"zerotune-{exp.name}-") for n in zerotune_groups(ray))  # none was made


@pytest.mark.e2e
def test_placement_waits_at_most_the_timeout_while_gpus_are_held(ray_cluster, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"GPU": 2.0}], strategy="STRICT_PACK")  # other work holding both GPUs
    ray.get(holder.ready(), timeout=30)
    try:
        backend = RayBackend(tiny_spec(write_config(tmp_path / "ds.json"), timeout_s=2), address=ray_cluster)
        exp = Experiment("waits", {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}, num_slots=1)
        start = time.monotonic()
        backend.run(exp, Reservation((Node("localhost", (0,)),)), tmp_path / "exp")
        assert 2 <= time.monotonic() - start < 15
    finally:
        remove_placement_group(holder)
    assert exp.status == Status.TIMEOUT and exp.metric is None
    assert "not placed after 2 s" in exp.error
    (group,) = [g for n, g in zerotune_groups(ray).items() if n.startswith(f"zerotune-{exp.name}-")]
    assert group["state"] == "REMOVED"


@pytest.mark.e2e
def test_tune_with_ray_backend_gives_the_local_backends_answer(ray_cluster, tmp_path):
    """``zerotune tune --backend ray`` and the local backend, on the same job, agree.

    "Same answer" is made deterministic by memory, not by throughput: CPU throughput here varies
    by +-20% between runs (two shared cores), so on a job where two configs are close the two
    backends could honestly pick different winners. This job (ZeRO stages 0-3 with DeepSpeed's
    default buckets, mbs capped at 1, gas held at 1, 2 GiB per rank) leaves one feasible choice: stages 1-3 need a
    2,000,000,000-byte reduce buffer per rank plus the rank's measured overhead, over the budget, so
    the memory model prunes them, and stage 0 runs at mbs 1 only. The two runs must then agree on
    everything the answer is made of: the experiments run and their outcomes, each stage's decision,
    and the optimal config byte for byte. Throughput plays no part in the answer, so the two runs
    share the CPU at once to keep the test short.
    """
    import ray

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": [1],  # gas held
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                               "zero_optimization": {"stage": "all"},
                               "autotuning": {"start_profile_step": 2, "end_profile_step": 3,
                                              "max_train_micro_batch_size_per_gpu": 1}}))

    def tune(results: Path, *backend_args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "zerotune", "tune", *backend_args, "--num_gpus", "2",
                                 "--device-memory", "2GiB", "--timeout", "300", "--results-dir", str(results),
                                 SCRIPT, *TINY, "--steps", "6", "--deepspeed_config", str(cfg)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    runs = {"ray": tune(tmp_path / "ray", "--backend", "ray", "--address", ray_cluster),
            "local": tune(tmp_path / "local")}
    outputs = {name: proc.communicate(timeout=600) for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, outputs[name][1][-3000:])

    def answer(results: Path) -> tuple[dict, dict, list[str]]:
        records = {r["name"]: (r["kind"], r["status"]) for r in
                   (json.loads(p.read_text()) for p in (results / "exps").glob("*/exp.json"))}
        decisions = [ln for ln in (results / "summary.txt").read_text().splitlines() if ln.startswith("ZeRO stage")]
        return json.loads((results / "ds_config_optimal.json").read_text()), records, decisions

    optimal, records, decisions = answer(tmp_path / "ray")
    assert (optimal, records, decisions) == answer(tmp_path / "local")
    assert optimal["zero_optimization"]["stage"] == 0
    assert optimal["train_micro_batch_size_per_gpu"] == 1 and optimal["train_batch_size"] == 2
    assert sorted(records.values()) == [("mbs", "ok"), ("profile", "ok")]
    assert [d.split(" - ")[0] for d in decisions] == ["ZeRO stage 0: explored", "ZeRO stage 1: pruned",
                                                       "ZeRO stage 2: pruned", "ZeRO stage 3: pruned"]
    (mbs_run,) = [name for name, (kind, _) in records.items() if kind == "mbs"]
    best = json.loads((tmp_path / "ray" / "exps" / mbs_run / "exp.json").read_text())
    assert best["metric"] > 0

    # Both of the Ray run's experiments ran in their own placement group, since removed.
    groups = zerotune_groups(ray)
    for name in records:
        (group,) = [g for n, g in groups.items() if n.startswith(f"zerotune-{name}-")]
        assert group["state"] == "REMOVED" and group["bundles"] == {0: {"GPU": 2.0, "CPU": 1.0}}
    assert processes_running(str(tmp_path)) == []
