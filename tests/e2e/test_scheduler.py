"""Tests for zerotune.run.scheduler with real processes: parallel slots, timeouts and hangs with no
process left, the results-dir lock, resume after the tuner is SIGKILLed.

The scheduler tests run the real ``deepspeed`` launcher (DS_ACCELERATOR=cpu) through
``LocalBackend`` on a small stand-in script written into ``tmp_path``: it does what a test needs
(hang, print forever, wait for a peer, spawn a daemon) and writes the ``metrics.json`` DeepSpeed's
engine would write to ``autotuning.metric_path``. The resume test tunes the bundled example.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.tiny import SCRIPT, TINY, best_pooled, write_config
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.run.backends.local import LocalBackend
from zerotune.run.processes import RUNNING_DIR
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool
from zerotune.run.store import ResultsLock

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

STAND_IN = r'''
import json, os, signal, sys, time

args = sys.argv[1:]
config_path = args[args.index("--deepspeed_config") + 1]
config = json.load(open(config_path))
plan = config["stand_in"]
rank = int(os.environ["LOCAL_RANK"])
exp_dir = os.path.dirname(config_path)


def note(name, **values):  # one small JSON file per process, written atomically
    path = os.path.join(exp_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(values, f)
    os.replace(path + ".tmp", path)


start = time.time()
note(f"rank{rank}.json", pid=os.getpid(), start=start, devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
print(f"stand-in rank {rank} started", flush=True)
if plan.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if plan.get("daemon"):  # a grandchild that leaves the process group and its parent (setsid + double fork)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            note(f"daemon{rank}.json", pid=os.getpid())
            time.sleep(10**6)
        os._exit(0)
    os.wait()
mode = plan["mode"]
if mode == "hang":
    time.sleep(10**6)
elif mode == "chatty":
    while True:
        print("still working", flush=True)
        time.sleep(0.3)
elif mode == "ok":
    saw_peers = None
    if plan.get("rendezvous"):  # wait (bounded) until `peers` ranks of any experiment have started
        rv = plan["rendezvous"]
        os.makedirs(rv, exist_ok=True)
        open(os.path.join(rv, str(os.getpid())), "w").close()
        deadline = time.time() + plan["wait_s"]
        while len(os.listdir(rv)) < plan["peers"] and time.time() < deadline:
            time.sleep(0.05)
        saw_peers = len(os.listdir(rv)) >= plan["peers"]
    time.sleep(plan.get("sleep", 0))
    note(f"rank{rank}.json", pid=os.getpid(), start=start, end=time.time(), saw_peers=saw_peers,
         devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if rank == 0:
        with open(config["autotuning"]["metric_path"], "w") as f:
            json.dump({"throughput": plan.get("throughput", 100.0), "latency": 25000.0, "FLOPS_per_gpu": 1e9}, f)
'''


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return script


def make_scheduler(script: Path, tmp_path: Path, slots: int = 2, **spec) -> Scheduler:
    user_config = tmp_path / "ds_config.json"
    user_config.write_text("{}")  # replaced per experiment by the backend
    launch = LaunchSpec(script=str(script), script_args=("--deepspeed_config", str(user_config)), cpu=True, **spec)
    return Scheduler(LocalBackend(launch), SlotPool(select_resources(local_slots=slots)), tmp_path / "exps")


def stand_in_exp(name: str, num_slots: int = 1, **plan) -> Experiment:
    return Experiment(name, {"train_micro_batch_size_per_gpu": 1, "stand_in": plan}, num_slots=num_slots)


def processes_of(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions ``marker``."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and any(marker in arg for arg in p.cmdline()) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# --- placement: two experiments at once -------------------------------------------------------


@pytest.mark.e2e
def test_two_half_pool_experiments_run_at_once_on_different_slots(stand_in, tmp_path):
    scheduler = make_scheduler(stand_in, tmp_path, slots=2, timeout_s=180)
    # Each rank waits (up to 60 s) until both have started: run one after the other, the first
    # would give up and report saw_peers=False.
    rv = str(tmp_path / "rendezvous")
    a, b = (stand_in_exp(n, mode="ok", rendezvous=rv, peers=2, wait_s=60, sleep=0.5, throughput=t)
            for n, t in (("a", 10.0), ("b", 20.0)))
    events = []
    scheduler.on_update = lambda e, event: events.append((event, e.name))
    done = scheduler.run([a, b])

    assert [(e.name, e.status, e.metric) for e in done] == [("a", Status.OK, 10.0), ("b", Status.OK, 20.0)]
    ranks = {n: read(tmp_path / "exps" / n / "rank0.json") for n in ("a", "b")}
    assert ranks["a"]["saw_peers"] and ranks["b"]["saw_peers"]
    # their [start, end] intervals overlap
    assert max(r["start"] for r in ranks.values()) < min(r["end"] for r in ranks.values())
    # on different device slots: the reservation (the launcher's --include) and what the rank saw
    assert {r["devices"] for r in ranks.values()} == {"0", "1"}
    worlds = [json.loads(base64.urlsafe_b64decode((tmp_path / "exps" / n / "cmd.txt").read_text()
                                                  .split("--world_info ")[1].split()[0])) for n in "ab"]
    assert sorted(w["localhost"] for w in worlds) == [[0], [1]]
    # both started before either ended (the threads' start order is theirs to choose)
    assert events[:2] == [("queued", "a"), ("queued", "b")]
    assert sorted(events[2:4]) == [("start", "a"), ("start", "b")]
    assert sorted(events[4:]) == [("end", "a"), ("end", "b")]
    assert scheduler.pool.free_slots == 2 and scheduler.launched == 2
    scheduler.backend.close()  # the tuning's end: its warm rank server stops (zerotune.run.warm)
    assert processes_of(str(stand_in)) == []


@pytest.mark.e2e
def test_the_ranks_sampled_memory_is_a_runs_peak_on_cpu_ranks_only(stand_in, tmp_path):
    # on CPU ranks the budget limits their VmData, which the backend samples; on CUDA that is host memory, not the
    # device's, so a run's peak comes from the probe's streams alone (none here: the stand-in writes no records).
    # Until session 17 an OOM run on an H200 showed a 2.28 GiB host peak against a 137.90 GiB device estimate.
    user_config = tmp_path / "ds_config.json"
    user_config.write_text("{}")
    peaks = {}
    for cpu in (True, False):
        launch = LaunchSpec(script=str(stand_in), script_args=("--deepspeed_config", str(user_config)), cpu=cpu,
                            timeout_s=120)
        scheduler = Scheduler(LocalBackend(launch), SlotPool(select_resources(local_slots=1)), tmp_path / f"exps_{cpu}")
        (done,) = scheduler.run([stand_in_exp("a", mode="ok", sleep=1.0)])
        assert done.status is Status.OK
        peaks[cpu] = done.peak_memory_bytes
    assert peaks[True] > 2**20 and peaks[False] is None


# --- timeouts and hangs: the whole tree is killed, tuning goes on -----------------------------


@pytest.mark.e2e
def test_hung_experiment_is_killed_with_every_process_and_tuning_continues(stand_in, tmp_path):
    hang_s = 15  # above the launcher's own silent start-up (imports), which is seconds on a loaded machine
    scheduler = make_scheduler(stand_in, tmp_path, slots=2, hang_timeout_s=hang_s, timeout_s=240)
    # 2 ranks that ignore SIGTERM, each with a daemon grandchild outside the launcher's process
    # group and tree; then an experiment that must still run.
    hung = stand_in_exp("hung", num_slots=2, mode="hang", ignore_term=True, daemon=True)
    after = stand_in_exp("after", mode="ok")
    start = time.monotonic()
    hung_done, after_done = scheduler.run([hung, after])
    took = time.monotonic() - start

    exp_dir = tmp_path / "exps" / "hung"
    assert hung_done.status == Status.TIMEOUT, (hung_done.error, (exp_dir / "stderr.log").read_text()[-2000:])
    assert hung_done.error == f"no output for {hang_s} s: killed as hung"
    assert hung_done.metric is None
    assert read(exp_dir / "exp.json")["status"] == "timeout"
    # bounded: the hang timeout after the ranks' last output, plus launcher start-up; not the 240 s timeout
    assert hang_s <= hung_done.wall_s < hang_s + 60, hung_done.wall_s
    pids = [read(exp_dir / f"{kind}{rank}.json")["pid"] for kind in ("rank", "daemon") for rank in (0, 1)]
    assert not [pid for pid in pids if alive(pid)], "processes of the hung experiment are still running"
    scheduler.backend.close()  # the tuning's end: its warm rank server stops (zerotune.run.warm)
    assert processes_of(str(stand_in)) == []
    assert list((tmp_path / "exps" / RUNNING_DIR).iterdir()) == []

    assert after_done.status == Status.OK and after_done.metric == 100.0
    assert scheduler.pool.free_slots == 2
    assert took < hang_s + 120


@pytest.mark.e2e
def test_timeout_kills_a_busy_experiment(stand_in, tmp_path):
    timeout_s = 20  # long enough for the launcher to start the rank on a loaded machine
    scheduler = make_scheduler(stand_in, tmp_path, slots=1, timeout_s=timeout_s, hang_timeout_s=None)
    (done,) = scheduler.run([stand_in_exp("busy", mode="chatty")])
    exp_dir = tmp_path / "exps" / "busy"
    assert done.status == Status.TIMEOUT, (done.error, (exp_dir / "stderr.log").read_text()[-2000:])
    assert done.error == f"killed after the {timeout_s} s timeout"
    assert timeout_s <= done.wall_s < timeout_s + 20, done.wall_s
    assert "still working" in (exp_dir / "stdout.log").read_text()  # it ran, and was not hung
    assert not alive(read(exp_dir / "rank0.json")["pid"])
    scheduler.backend.close()  # the tuning's end: its warm rank server stops (zerotune.run.warm)
    assert processes_of(str(stand_in)) == []


# --- the tuner itself killed: its experiments are orphans until the next run ------------------

TUNER = r'''
import sys
from pathlib import Path
from zerotune.core.launch import LaunchSpec
from zerotune.run.backends.local import LocalBackend
from zerotune.core.experiment import Experiment
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

script, user_config, exps = sys.argv[1:4]
# cold: a warm server stops its runs itself once its tuner is gone (tests/e2e/test_warm.py); a cold launcher outlives it
spec = LaunchSpec(script=script, script_args=("--deepspeed_config", user_config), cpu=True, warm=False)
scheduler = Scheduler(LocalBackend(spec), SlotPool(select_resources(local_slots=1)), Path(exps))
scheduler.run([Experiment("hung", {"train_micro_batch_size_per_gpu": 1, "stand_in": {"mode": "hang"}})])
'''


@pytest.mark.e2e
def test_experiments_of_a_sigkilled_tuner_are_killed_by_the_next_run(stand_in, tmp_path):
    (tmp_path / "tuner.py").write_text(TUNER)
    (tmp_path / "ds_config.json").write_text("{}")
    exps = tmp_path / "exps"
    tuner = subprocess.Popen([sys.executable, str(tmp_path / "tuner.py"), str(stand_in),
                              str(tmp_path / "ds_config.json"), str(exps)], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        rank = wait_for(lambda: (exps / "hung" / "rank0.json").exists() and read(exps / "hung" / "rank0.json"),
                        120, "the hung experiment's rank to start")
    finally:
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait()
    # The launcher runs in its own session (so a timeout can kill its whole group): SIGKILL of
    # the tuner's group does not reach it, and no code of the tuner runs to stop it.
    assert alive(rank["pid"]), "expected the killed tuner's experiment to outlive it"
    assert read(exps / "hung" / "exp.json")["status"] == "interrupted"
    assert [p.name for p in (exps / RUNNING_DIR).iterdir()] == ["hung.json"]
    # what DeepSpeed's CPU communication would have left in /dev/shm for that run's port
    port = read(exps / RUNNING_DIR / "hung.json")["master_port"]
    shm = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
    shm.write_bytes(b"")

    # The next run on the same exps dir kills them before it launches anything.
    scheduler = make_scheduler(stand_in, tmp_path, slots=1, timeout_s=120)
    (done,) = scheduler.run([stand_in_exp("next", mode="ok")])
    assert done.status == Status.OK
    assert not alive(rank["pid"])
    scheduler.backend.close()  # the tuning's end: its warm rank server stops (zerotune.run.warm)
    assert processes_of(str(stand_in)) == []
    assert list((exps / RUNNING_DIR).iterdir()) == []
    assert not shm.exists()


# --- the results-dir lock ---------------------------------------------------------------------


def test_tune_on_a_locked_results_dir_exits_2(tmp_path):
    cfg = write_config(tmp_path / "ds.json")
    results = tmp_path / "results"
    with ResultsLock(results):
        proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "3GiB",
                               "--results-dir", str(results), SCRIPT, *TINY, "--deepspeed_config", str(cfg)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by another zerotune (pid {os.getpid()})" in proc.stderr
    assert not (results / "exps").exists()  # nothing was run or removed


# --- resume after the tuner is SIGKILLed mid-run ----------------------------------------------


@pytest.mark.e2e
def test_resume_after_sigkill_reruns_only_the_interrupted_experiment(tmp_path):
    cfg = write_config(tmp_path / "ds.json", max_train_micro_batch_size_per_gpu=2)
    data = json.loads(cfg.read_text())
    data["zero_optimization"]["stage"] = 0  # profile, z0_mbs1, z0_mbs2: three experiments
    cfg.write_text(json.dumps(data))
    results = tmp_path / "results"
    exps = results / "exps"
    argv = [sys.executable, "-m", "zerotune", "tune", "--num_gpus", "1", "--device-memory", "3GiB",
            "--results-dir", str(results), "--timeout", "300", SCRIPT, *TINY, "--steps", "6",
            "--deepspeed_config", str(cfg)]

    def record(name):
        try:
            return read(exps / name / "exp.json")
        except (OSError, ValueError):
            return {}

    def status(name):
        return record(name).get("status")

    def profile_name():  # the profile run, found by its kind (its name carries its config)
        return next((p.parent.name for p in exps.glob("*/exp.json") if record(p.parent.name).get("kind") == "profile"),
                    None)

    def later_experiment_running():
        profile = profile_name()
        if profile is None or status(profile) != "ok":
            return None
        started = [p.parent.name for p in exps.glob("*/exp.json")
                   if p.parent.name != profile and status(p.parent.name) == "interrupted"]
        # Wait until it trains (past deepspeed.initialize): the kill then leaves real orphans behind,
        # and the next run does not kill them while they hold torch's JIT-extension build lock (a
        # rank killed there leaves ~/.cache/torch_extensions/.../lock behind, and every later
        # DeepSpeed run on the machine waits for it forever).
        return next((n for n in started if "step 0 loss" in _text(exps / n / "stdout.log")), None)

    tuner = subprocess.Popen(argv, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "first.log", "w"))
    try:
        interrupted = wait_for(later_experiment_running, 420, "the profile to finish and a later experiment to train")
    finally:
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait()
    finished = {p.parent.name: p.read_text() for p in exps.glob("*/exp.json")
                if read(p)["status"] in ("ok", "oom")}  # the outcomes a rerun reuses (Status.reusable)
    profile = profile_name()
    assert profile in finished and interrupted not in finished
    assert status(interrupted) == "interrupted"
    orphans = [p.pid for p in processes_of(str(exps))]

    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [pid for pid in orphans if alive(pid)]
    assert processes_of(str(exps)) == []
    assert list((exps / RUNNING_DIR).iterdir()) == []

    # finished results were kept and not re-run; the interrupted one was re-run
    for name, text in finished.items():
        assert (exps / name / "exp.json").read_text() == text, f"{name} was re-run"
    assert status(interrupted) == "ok", read(exps / interrupted / "exp.json")["error"]
    records = [read(p) for p in exps.glob("*/exp.json")]
    launched_now = len(records) - len(finished)
    assert f"({launched_now} launched now)" in (results / "summary.txt").read_text()
    assert f"cached {profile}: ok" in again.stderr and f"start {interrupted}" in again.stderr
    assert f"start {profile}" not in again.stderr

    # the answer is the best of all finished experiments, old and new (pooled over re-measurements)
    assert read(results / "ds_config_optimal.json") == best_pooled(records)["ds_config"]
