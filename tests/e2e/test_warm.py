"""Warm launches (zerotune.run.warm): what is preloaded, the rank contract warm against DeepSpeed's own launcher,
warm and cold measuring the same, the cold re-run when the server goes away, and no server left by any end."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.deepspeed.extensions import default_root, last_build_s
from zerotune.run.backends.local import LocalBackend
from zerotune.run.processes import RUNNING_DIR, reap_orphans, run_processes
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.warm.client import SERVER_RECORD, WarmRun, _exchange
from zerotune.run.warm.preload import script_imports

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")  # 2 ranks on 2 cores
ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--vocab", "512", "--seq-len", "32", "--d-model", "64", "--n-layer", "2", "--n-head", "2"]
GIB = 2**30
# Steps of about 80 ms: at TINY's 15 ms a step is mostly Python overhead, and warm ranks read 10-17% faster
# than cold ones in CI (a forked heap), where at this size and above the two agree within 3% (D303).
STEADY = ["--vocab", "2048", "--seq-len", "128", "--d-model", "128", "--n-layer", "2", "--n-head", "2"]


def test_the_scripts_top_level_imports_are_read_in_order_without_running_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, torch.nn as nn\n"
                      "from transformers import GPT2Config, GPT2LMHeadModel\n"
                      "from . import sibling\n"
                      "from yaml import *\n"
                      "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n"
                      "if True:\n    from transformers import Trainer\n"
                      "def main():\n    import scipy\n"
                      "class C:\n    import sympy\n"
                      "raise SystemExit('never run')\n")
    assert script_imports(script) == [("os", ()), ("torch.nn", ()),
                                      ("transformers", ("GPT2Config", "GPT2LMHeadModel", "Trainer")),
                                      ("yaml", ()), ("numpy", ())]


def test_a_run_whose_exit_line_came_with_the_launch_answer_is_not_lost():
    """A run that ends at once: the server's pid line and exit line arrive in one read; the exit is kept."""
    tuner, server = socket.socketpair()
    try:
        server.sendall(b'{"pid": 4242}\n{"exit": 3}\n')
        answer, rest = _exchange(tuner, {"op": "launch"})
        assert answer == {"pid": 4242} and json.loads(server.recv(100)) == {"op": "launch"}
        run = WarmRun(tuner, answer["pid"], rest)
        assert (run.poll(), run.lost) == (3, False)
    finally:
        tuner.close()
        server.close()


PRELOAD_CHECK = r'''
import json, sys
from zerotune.run.warm.preload import fork_unsafe, preload
done = preload(sys.argv[1])
print(json.dumps({"imported": done.imported, "skipped": done.skipped, "unsafe": fork_unsafe(),
                  "gpt2": "transformers.models.gpt2.modeling_gpt2" in sys.modules,
                  "yaml": getattr(sys.modules.get("yaml"), "__file__", None)}))
'''


PRELOADING = """
import os, subprocess, sys, time
if sys.argv[1] == "tuner":  # a tuner that starts a server (its own session, as the tuner starts one) and is killed
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "server"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(60)
from zerotune.run.warm.preload import watch_parent
stop = watch_parent(os.getppid())
builder = subprocess.Popen(["sleep", "60"])  # a build the preload started, in the server's process group
print(builder.pid, flush=True)
time.sleep(60)  # a preload that takes long
"""


def test_a_preloading_server_and_its_build_end_with_their_tuner_and_the_watch_leaves_no_thread():
    import psutil
    tuner = subprocess.Popen([sys.executable, "-c", PRELOADING, "tuner", PRELOADING], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(tuner.stdout.readline()))
    deadline = time.monotonic() + 30
    while len(server.children()) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    (builder,) = server.children()
    tuner.kill()
    tuner.wait()
    gone, alive = psutil.wait_procs([server, builder], timeout=3)
    assert alive == [] or all(p.status() == psutil.STATUS_ZOMBIE for p in alive)
    # stopped, the watch's thread is gone: the server may fork
    from zerotune.run.warm.preload import watch_parent
    before = threading.active_count()
    stop = watch_parent(os.getppid())
    assert threading.active_count() == before + 1
    stop()
    assert threading.active_count() == before


def test_a_killed_tuners_warm_socket_dir_is_removed_by_the_rerun_and_nothing_else_is(tmp_path):
    import tempfile

    from zerotune.run.backends.stop_handles import remove_socket_dir, socket_dir_handle
    from zerotune.run.warm.client import WarmServer
    server = WarmServer("train.py", {}, tmp_path / RUNNING_DIR)  # its socket dir is made with it
    assert server._dir.parent == Path(tempfile.gettempdir()) and server._dir.is_dir()
    record = {"name": SERVER_RECORD, "token": "no-process-has-this-token", "master_port": None,
              "host": socket.gethostname(), "tuner_pid": 2**22 + 1, "tuner_create_time": 0.0, "leader": None,
              "since": None, "stop": socket_dir_handle(server._dir)}  # as a SIGKILLed tuner left it
    (tmp_path / RUNNING_DIR).mkdir()
    (tmp_path / RUNNING_DIR / f"{SERVER_RECORD}.json").write_text(json.dumps(record))
    assert reap_orphans(tmp_path / RUNNING_DIR) == [SERVER_RECORD] and not server._dir.exists()
    # a handle naming anything but a zerotune-warm-* dir directly in the temp dir removes nothing
    for other in (tmp_path, Path(tempfile.gettempdir()) / "not-zerotunes", tmp_path / "zerotune-warm-x"):
        other.mkdir(exist_ok=True)
        assert not remove_socket_dir(socket_dir_handle(other)) and other.is_dir()
    (Path(tempfile.gettempdir()) / "not-zerotunes").rmdir()


def test_the_preload_takes_installed_distributions_only_and_stays_fork_safe(tmp_path):
    (tmp_path / "yaml.py").write_text("raise RuntimeError('the script directory is never imported')\n")
    script = tmp_path / "train.py"
    script.write_text("import json\nimport yaml\nimport psutil\nimport zt_not_installed_anywhere\n"
                      "from transformers import GPT2LMHeadModel\n")
    run = subprocess.run([sys.executable, "-c", PRELOAD_CHECK, str(script)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=tmp_path.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    done = json.loads(run.stdout.splitlines()[-1])
    assert done["imported"] == ["torch", "deepspeed", "deepspeed.runtime.engine", "psutil", "transformers"]
    assert done["skipped"] == {"yaml": "not an installed distribution's module",
                               "zt_not_installed_anywhere": "not an installed distribution's module"}
    assert done["gpt2"]  # the from-import's name fetched: transformers' lazy module loaded
    assert not done["yaml"].startswith(str(tmp_path))  # the installed yaml (DeepSpeed imports it), never the script's
    assert done["unsafe"] is None  # no thread, no CUDA


DUMP = r'''
import json, os, resource, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
        "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "ZT_USER_VAR"]
record = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
          "name": __name__, "file": __file__, "data_limit": resource.getrlimit(resource.RLIMIT_DATA)[0],
          "stdin": sys.stdin.read(), "port": os.environ["MASTER_PORT"]}
out = os.path.join(os.environ["PYTHON_ZEROTUNE_PROBE_DIR"], "dump%s.json" % os.environ["RANK"])
with open(out, "w") as f:
    json.dump(record, f)
print("rank", os.environ["RANK"], "says hello")
print("rank", os.environ["RANK"], "warns", file=sys.stderr)
'''


def _run_one(tmp: Path, script: Path, warm: bool, name: str) -> tuple[Experiment, Path]:
    spec = LaunchSpec(script=str(script), script_args=("--flag", "a b", "--deepspeed_config", "ds.json"), cpu=True,
                      device_memory_bytes=3 * GIB, start_profile_step=2, end_profile_step=3, timeout_s=120,
                      warm=warm)
    backend = LocalBackend(spec)
    exps = tmp / f"exps_{name}"
    try:
        (done,) = Scheduler(backend, SlotPool(select_resources(local_slots=2)), exps).run(
            [Experiment(name, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
                        num_slots=2)])
    finally:
        backend.close()
    return done, exps / name


@pytest.mark.e2e  # DeepSpeed's launcher and a warm server: about 10 s
def test_a_warm_rank_gets_what_deepspeeds_launcher_gives_a_rank(tmp_path, monkeypatch):
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    monkeypatch.setenv("ZT_USER_VAR", "from the user's shell")
    monkeypatch.chdir(tmp_path)
    seen = {}
    for warm in (False, True):
        exp, exp_dir = _run_one(tmp_path, script, warm, "warm" if warm else "cold")
        assert exp.launch == ("warm" if warm else "cold") and exp.launch_note == ""
        dumps = [json.loads((exp_dir / f"dump{rank}.json").read_text()) for rank in (0, 1)]
        ports = {d.pop("port") for d in dumps}
        assert len(ports) == 1 and f"--master_port {ports.pop()}" in (exp_dir / "cmd.txt").read_text()
        out, err = (exp_dir / "stdout.log").read_text(), (exp_dir / "stderr.log").read_text()
        seen[warm] = (dumps, sorted(line for line in out.splitlines() if line.startswith("rank")),
                      sorted(line for line in err.splitlines() if line.startswith("rank")), exp.exit_code)
    cold_dumps, warm_dumps = seen[False][0], seen[True][0]
    assert cold_dumps[1]["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
                                    "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                    "CUDA_VISIBLE_DEVICES": "0,1", "DS_ACCELERATOR": "cpu",
                                    "ZT_USER_VAR": "from the user's shell"}
    for cold, warm in zip(cold_dumps, warm_dumps):
        config = cold["argv"][-1]
        assert config.endswith("exps_cold/cold/ds_config.json")
        warm["argv"][-1] = warm["argv"][-1].replace("exps_warm/warm/", "exps_cold/cold/")
        assert warm == cold  # env, argv, cwd, sys.path[0], __main__, __file__, RLIMIT_DATA, stdin
    assert cold_dumps[0]["argv"][:4] == [str(script), "--local_rank=0", "--flag", "a b"]
    assert cold_dumps[0]["data_limit"] == 3 * GIB and cold_dumps[0]["stdin"] == ""
    assert seen[True][1:] == seen[False][1:]  # the same lines on stdout and stderr, the same exit status


def _interleaved(tmp: Path, rounds: int) -> dict[bool, list[Experiment]]:
    (tmp / "ds.json").write_text("{}")
    runs: dict[bool, list[Experiment]] = {False: [], True: []}
    config = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 16, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    schedulers = {}
    for warm in (False, True):
        spec = LaunchSpec(script=GPT, script_args=(*STEADY, "--steps", "20", "--deepspeed_config", str(tmp / "ds.json")),
                          cpu=True, device_memory_bytes=3 * GIB, start_profile_step=3, end_profile_step=10,
                          timeout_s=300, warm=warm)
        schedulers[warm] = Scheduler(LocalBackend(spec), SlotPool(select_resources(local_slots=2)),
                                     tmp / f"exps_{warm}")
    for r in range(rounds):
        for warm in (False, True):  # a cold run first: the warm server preloads its next template meanwhile
            (done,) = schedulers[warm].run([Experiment(f"z1_{'warm' if warm else 'cold'}_{r}", dict(config),
                                                       num_slots=2)])
            assert done.status is Status.OK, (done.error, done.launch_note)
            runs[warm].append(done)
    for scheduler in schedulers.values():
        scheduler.backend.close()
    return runs


@pytest.mark.e2e  # 4 cold and 4 warm runs, interleaved: about 60 s (with 3 each, medians of CPU noise at +-10%
# differed by 18% in a CI run)
@pytest.mark.serial  # it compares readings: a neighbour's load would move them
def test_warm_and_cold_runs_of_one_config_measure_the_same(tmp_path):
    runs = _interleaved(tmp_path, rounds=4)
    cold, warm = runs[False], runs[True]
    assert {e.launch for e in cold} == {"cold"} and {e.launch for e in warm} == {"warm"}
    med = {k: statistics.median(e.metric for e in v) for k, v in runs.items()}
    noise = max(max(e.metric for e in v) / min(e.metric for e in v) - 1 for v in runs.values())
    assert abs(med[True] / med[False] - 1) <= max(noise, 0.10), [(e.launch, e.metric) for e in cold + warm]
    peaks = {k: statistics.median(e.peak_memory_bytes for e in v) for k, v in runs.items()}
    assert abs(peaks[True] / peaks[False] - 1) <= 0.05, peaks
    # what is saved is start-up, never measuring (the first warm run also waits for the server's preload)
    assert max(e.startup_s for e in warm[1:]) < min(e.startup_s for e in cold) / 2, [e.startup_s for e in cold + warm]


@pytest.mark.e2e  # a run whose server is killed, then its cold re-run: about 20 s
def test_a_run_whose_server_goes_away_is_rerun_cold_and_says_so(tmp_path):
    (tmp_path / "ds.json").write_text("{}")
    spec = LaunchSpec(script=GPT, script_args=(*TINY, "--steps", "400", "--deepspeed_config", str(tmp_path / "ds.json")),
                      cpu=True, device_memory_bytes=3 * GIB, start_profile_step=3, end_profile_step=6, timeout_s=300)
    backend = LocalBackend(spec)
    exps = tmp_path / "exps"
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

    def kill_the_server_once_a_rank_steps():
        deadline = time.monotonic() + 120
        while not list((exps / "z0").glob("probe.rank*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(backend._warm.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_server_once_a_rank_steps)
    killer.start()
    try:
        (done,) = Scheduler(backend, SlotPool(select_resources(local_slots=2)), exps).run(
            [Experiment("z0", config, num_slots=2)])
    finally:
        killer.join()
        backend.close()
    assert done.status is Status.OK, done.error
    assert (done.launch, done.launch_note) == ("cold", "re-run cold: its warm server went away during the run")
    assert "deepspeed.launcher.launch" in (exps / "z0" / "cmd.txt").read_text()


def _tune(tmp: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real tuning whose answer is not a matter of noise: ZeRO-0 at mbs 1 or 16 (the tiny model's step time barely
    grows with mbs: 16 is several times the samples/s), gas 1 (the global batch is capped at 32); ``env``: the
    tuner's environment (default this process's)."""
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": [1, 16], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
        "autotuning": {"start_profile_step": 2, "end_profile_step": 3, "max_train_batch_size": 32}}))
    return subprocess.Popen([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "3GiB",
                             "--results-dir", str(tmp / "results"), "--timeout", "240", *extra, GPT, *TINY, "--steps",
                             "6", "--deepspeed_config", str(tmp / "ds.json")], cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)


def _server_token(running: Path, tuner: subprocess.Popen) -> str:
    """The warm server's run token, read from its running record once an experiment runs beside it."""
    deadline = time.monotonic() + 180
    while True:
        names = {p.stem for p in running.glob("*.json")}
        if SERVER_RECORD in names and len(names) > 1:
            return json.loads((running / f"{SERVER_RECORD}.json").read_text())["token"]
        assert time.monotonic() < deadline and tuner.poll() is None, tuner.communicate()[1][-3000:]
        time.sleep(0.05)


def _gone(token: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while run_processes(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    return run_processes(token) == []


@pytest.mark.e2e  # two real tunings stopped in their first runs: about 30 s
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_no_warm_server_outlives_a_stopped_tuner(tmp_path, sig):
    tuner = _tune(tmp_path)
    running = tmp_path / "results" / "exps" / RUNNING_DIR
    try:
        token = _server_token(running, tuner)
        os.kill(tuner.pid, sig)
        tuner.communicate(timeout=60)
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
            tuner.wait()
    assert tuner.returncode == (143 if sig == signal.SIGTERM else -9)
    # the server stops with its tuner: told by it (SIGTERM), or seeing it gone (SIGKILL); its runs with it
    assert _gone(token, within_s=5)
    if sig == signal.SIGKILL:  # the records a killed tuner left: a rerun reaps them before anything else
        assert SERVER_RECORD in reap_orphans(running)
    assert list(running.glob("*.json")) == []


def _machine_cache(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` with its mtime (ns) and bytes."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


@pytest.mark.e2e  # two real tunings, cold then warm, and one JIT build of the shared-memory op: about 1 min
# not serial: the two answers it compares are several times apart in samples/s (_tune), whatever the load
def test_a_tuning_runs_warm_to_the_same_answer_as_cold_and_never_writes_the_machines_cache(tmp_path):
    # the machine's JIT cache as the tuner sees it (TORCH_EXTENSIONS_DIR), its ops copied from this machine's; the
    # shared-memory op's ninja log is missing, so loading it there would rebuild it in place
    machine = tmp_path / "machine_cache"
    for op in ("deepspeed_shm_comm", "fused_adam"):
        shutil.copytree(default_root() / op, machine / op, ignore=shutil.ignore_patterns("lock"))
    (machine / "deepspeed_shm_comm" / ".ninja_log").unlink(missing_ok=True)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(machine), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    before = _machine_cache(machine)
    answers, summaries, walls = {}, {}, {}
    for mode, extra in (("cold", ("--cold-launch",)), ("warm", ())):
        work = tmp_path / mode
        work.mkdir()
        started = time.monotonic()
        tuner = _tune(work, *extra, env=env)
        running = work / "results" / "exps" / RUNNING_DIR
        token = _server_token(running, tuner) if mode == "warm" else None
        _, err = tuner.communicate(timeout=600)
        assert tuner.returncode == 0, err[-3000:]
        summaries[mode], walls[mode] = (work / "results" / "summary.txt").read_text(), time.monotonic() - started
        records = [json.loads(p.read_text()) for p in (work / "results" / "exps").glob("*/exp.json")]
        assert {r["launch"] for r in records} == {mode}, [(r["name"], r["launch"], r["launch_note"]) for r in records]
        optimal = json.loads((work / "results" / "ds_config_optimal.json").read_text())
        answers[mode] = (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"])
        if token is not None:
            assert run_processes(token) == []  # the tuning's answer ends its server
    assert answers["warm"] == answers["cold"] == (0, 16)
    assert _machine_cache(machine) == before  # neither tuning nor its warm server wrote a byte there
    # the cold tuning's ranks built the op in its exps dir's cache, and its summary gives ninja's own time for it;
    # the warm tuning seeded that build from zerotune's cache and built nothing
    built = re.search(r"JIT builds paid by this tuning: deepspeed_shm_comm (\d+) s", summaries["cold"])
    log = tmp_path / "cold" / "results" / "exps" / ".torch_extensions" / "deepspeed_shm_comm" / ".ninja_log"
    assert built and 1 <= int(built[1]) < walls["cold"], summaries["cold"]
    assert int(built[1]) == round(last_build_s(log, "deepspeed_shm_comm.so"))
    assert "JIT builds paid" not in summaries["warm"]
