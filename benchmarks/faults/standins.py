"""A stand-in ``deepspeed`` launcher and rank, and the real ``zerotune`` CLI driven with them.

The stand-in launcher (:data:`LAUNCHER`: one child per slot, forwards SIGTERM and exits, kills the others when a
rank fails, as DeepSpeed's ``launch.py`` does) starts stand-in ranks (:data:`RANK`: write DeepSpeed's result files,
a shared-memory file like DeepSpeed's CPU comm, or misbehave on cue). The tuner is the real ``zerotune`` CLI in its
own process (:data:`DRIVER` only points the launcher at the stand-in), so a signal reaches it as it reaches a
user's. A tuning takes about 3 s (the tuner's own start-up, importing torch).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

RANK = r'''
"""A stand-in DeepSpeed rank: profile -> model_info.json; else end_profile_step steps, then
metrics.json (rank 0). $STANDIN_PLAN (JSON {name substring: fault}) makes it misbehave."""
import json, os, signal, socket, sys, time

args = sys.argv[1:]
config_path = args[args.index("--deepspeed_config") + 1]
config = json.load(open(config_path))
rank = int(os.environ.get("LOCAL_RANK", "0"))
if "autotuning" not in config:  # the training 'zerotune run' starts with the optimal config
    # what DeepSpeed's CPU comm leaves in /dev/shm, as below
    open(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.environ['MASTER_PORT']}_{rank}", "wb").close()
    print(f"training rank {rank} pid {os.getpid()}", flush=True)
    time.sleep(float(os.environ.get("STANDIN_TRAIN_S", "0")))
    sys.exit(0)
at = config["autotuning"]
exp_dir = os.path.dirname(config_path)
name = os.path.basename(exp_dir)
plan = json.load(open(os.environ["STANDIN_PLAN"])) if os.environ.get("STANDIN_PLAN") else {}
fault = next((f for key, f in sorted(plan.items()) if key in name), "")


def write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# what DeepSpeed's CPU comm leaves in /dev/shm, one file per rank and master port
shm = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.environ['MASTER_PORT']}_{rank}"
open(shm, "wb").close()
print(f"stand-in rank {rank} of {name} pid {os.getpid()}", flush=True)
if rank == 0:  # rank 0 listens on the master port, as torch's TCPStore does
    store = socket.socket()
    try:
        store.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
    except OSError:
        print(f"RuntimeError: The server socket has failed to listen on any local network address. port: "
              f"{os.environ['MASTER_PORT']}, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use",
              file=sys.stderr, flush=True)
        sys.exit(1)
if at.get("model_info", {}).get("profile"):
    if rank == 0:
        write(at["model_info_path"], json.dumps({"num_params": 1_000_000, "trainable_num_params": 1_000_000,
                                                  "activation_mem_per_gpu": 1000}))
    sys.exit(0)
stage, mbs = config["zero_optimization"]["stage"], config["train_micro_batch_size_per_gpu"]
for step in range(at["end_profile_step"]):
    if fault == "crash_at_step" and step == 2:
        time.sleep(0.5 * rank)  # every rank crashes, one after the other: two tracebacks at once interleave on stderr
        raise RuntimeError("stand-in crash at step 2")
    if fault == "sigkill_rank" and step == 2 and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"step {step}", flush=True)
    time.sleep(0.01)  # a step: the tuner raises end_profile_step to its cap, about 20 steps
if fault == "hang":
    time.sleep(10**6)
if fault == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    time.sleep(10**6)
if fault == "slow":  # a long run, so a tuner can be stopped while it runs
    time.sleep(float(os.environ.get("STANDIN_SLOW_S", "3")))
if fault == "oom":
    print("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
          "you tried to allocate 1073741824 bytes", file=sys.stderr, flush=True)
    sys.exit(1)
if rank == 0:
    if fault == "garbage_metrics":
        open(at["metric_path"], "wb").write(b"\x00\xff\xfe garbage {")
    elif fault == "truncated_metrics":
        open(at["metric_path"], "w").write('{"throughput": 12')
    else:
        write(at["metric_path"], json.dumps({"throughput": 100.0 * mbs / (1 + 0.25 * stage),
                                             "latency": 1e4 * (1 + 0.25 * stage) / mbs, "FLOPS_per_gpu": 1e9}))
if fault == "garbage_probe":  # the step probe's stream, garbled: binary, a wrong-typed record, a cut line
    with open(os.path.join(os.environ["PYTHON_ZEROTUNE_PROBE_DIR"], f"probe.rank{rank}.jsonl"), "wb") as f:
        f.write(b'\xff\x00\n{"step": "x", "wall_s": "abc", "train_batch_size": null}\n[1, 2]\n{"step": 3, "wa')
'''

LAUNCHER = r'''
"""A stand-in for DeepSpeed's launch.py: --world_info B64 --master_addr A --master_port P SCRIPT ARGS."""
import base64, json, os, signal, subprocess, sys, time

args = sys.argv[1:]
world, port = args[args.index("--world_info") + 1], args[args.index("--master_port") + 1]
script_and_args = args[args.index("--master_port") + 2:]
slots = json.loads(base64.urlsafe_b64decode(world))["localhost"]
children = []
for rank, slot in enumerate(slots):
    env = dict(os.environ, LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(len(slots)), MASTER_PORT=port,
               CUDA_VISIBLE_DEVICES=str(slot))
    children.append(subprocess.Popen([sys.executable, "-u", *script_and_args], env=env))


def stop(signum, frame):  # as DeepSpeed's launch.py: pass it on, and go
    for c in children:
        c.send_signal(signal.SIGTERM)
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
while children:
    for c in list(children):
        rc = c.poll()
        if rc is None:
            continue
        children.remove(c)
        if rc != 0:  # one rank failed: kill the others (launch.py's sigkill_handler)
            for other in children:
                other.kill()
            print(f"exit code {rc}: a rank failed", file=sys.stderr, flush=True)
            sys.exit(rc if rc > 0 else 1)
    time.sleep(0.02)
'''

DRIVER = r'''
"""The zerotune CLI with the stand-in launcher in place of deepspeed's (argv: LAUNCHER then the CLI's)."""
import os
import sys
import zerotune.deepspeed.launcher as launcher
from zerotune import cli

fake = sys.argv[1]
launcher.node_launcher = lambda: [sys.executable, fake]
if os.environ.get("STANDIN_TAKE_PORT"):  # the Nth launch gets a master port another process listens on
    import socket
    import zerotune.run.backends.local as local
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    free, launches = local.free_port, []

    def free_port():
        launches.append(1)
        return taken.getsockname()[1] if len(launches) == int(os.environ["STANDIN_TAKE_PORT"]) else free()
    local.free_port = free_port
sys.exit(cli.main(sys.argv[2:]))
'''

BASE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": [0, 1]},
               "autotuning": {"max_train_micro_batch_size_per_gpu": 2, "start_profile_step": 2,
                              "end_profile_step": 4}}
ANSWER = {"stage": 0, "mbs": 2, "metric": 200.0}  # the stand-in's fastest config: 100 * mbs / (1 + stage / 4)


def tune_argv(work: Path, *extra: str, results: str = "results", ranks: int = 1) -> list[str]:
    return ["tune", "--num_gpus", str(ranks), "--device-memory", "2GiB", "--results-dir", str(work / results),
            "--timeout", "30", *extra, str(work / "rank.py"), "--deepspeed_config", str(work / "ds.json")]


def start_tuner(work: Path, argv: list[str], plan: dict | None = None, **env) -> subprocess.Popen:
    """The real CLI in its own process (and session, as a shell job), with the stand-in launcher."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", **env)
    if plan is not None:
        (work / "plan.json").write_text(json.dumps(plan))
        environ["STANDIN_PLAN"] = str(work / "plan.json")
    return subprocess.Popen([sys.executable, str(work / "driver.py"), str(work / "launcher.py"), *argv], cwd=work,
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_tuner(work: Path, argv: list[str], plan: dict | None = None, timeout: float = 120, **env):
    proc = start_tuner(work, argv, plan, **env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def records(results: Path) -> dict[str, dict]:
    out = {}
    for path in (results / "exps").glob("*/exp.json"):
        out[path.parent.name] = json.loads(path.read_text())
    return out


def answer(results: Path) -> dict:
    cfg = json.loads((results / "ds_config_optimal.json").read_text())
    return {"stage": cfg["zero_optimization"]["stage"], "mbs": cfg["train_micro_batch_size_per_gpu"]}
