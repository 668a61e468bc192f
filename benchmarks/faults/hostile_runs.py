"""Hostile round two, runs (issue 28): the cases tests/hostile/test_hostile_runs.py asserts and benchmarks/fault_matrix.py
counts (:func:`matrix_cases`).

Each runs the real ``zerotune`` CLI in its own process with the stand-in launcher (:mod:`benchmarks.faults.standins`)
and a stand-in rank of its own (:data:`RANK`: DeepSpeed's result files, plus the probe's stream, a barrier standing
for a collective, a self-inflicted SIGSTOP, a helper that leaves the run's tree, group, session and environment),
and returns what :func:`matrix_cases` reports: why the fault was not survived (empty when it was), finished results
lost or changed, processes left, tracebacks seen.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Callable

import psutil

from benchmarks.faults.processes import processes_of_tuner, stand_in_processes
from benchmarks.faults.standins import ANSWER, BASE_CONFIG, DRIVER, LAUNCHER, answer, records, start_tuner, tune_argv

RANK = r'''
"""A stand-in DeepSpeed rank (issue 28): profile -> model_info.json; else end_profile_step steps, then
metrics.json (rank 0). $STANDIN_PLAN (JSON {name substring: fault}) makes it misbehave."""
import json, os, signal, sys, time

args = sys.argv[1:]
config_path = args[args.index("--deepspeed_config") + 1]
config = json.load(open(config_path))
rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
at = config["autotuning"]
exp_dir = os.path.dirname(config_path)
name = os.path.basename(exp_dir)
plan = json.load(open(os.environ["STANDIN_PLAN"])) if os.environ.get("STANDIN_PLAN") else {}
fault = next((f for key, f in sorted(plan.items()) if key in name), "")
print(f"stand-in rank {rank} of {name} pid {os.getpid()}", flush=True)
if at.get("model_info", {}).get("profile"):
    if fault == "sigstop":  # a profile run that never ends
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 0:
        with open(at["model_info_path"], "w") as f:
            json.dump({"num_params": 1_000_000, "trainable_num_params": 1_000_000, "activation_mem_per_gpu": 1000}, f)
    sys.exit(0)


def barrier(step):  # what a collective does: wait for every rank
    open(os.path.join(exp_dir, f"barrier.{step}.{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(exp_dir, f"barrier.{step}.{r}")) for r in range(world)):
        time.sleep(0.01)


def helper():  # a daemon: its own session, a cleared environment, orphaned by a double fork
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        with open(os.path.join(exp_dir, "helper.pid"), "w") as f:
            f.write(str(os.getpid()))
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", "stand-in-helper"], {})
    os.waitpid(child, 0)


stage, mbs = config["zero_optimization"]["stage"], config["train_micro_batch_size_per_gpu"]
if fault == "false_oom":
    # rank 0 first: two unbuffered tracebacks written at the same instant interleave byte by byte in the one log
    # ("FileNotFoundErrorFileNotFoundError: : [E..."), which no reader can take apart
    time.sleep(0.5 * rank)
    print("read 4096 samples out of memory-mapped shards", flush=True)
    raise FileNotFoundError(2, "No such file or directory", "/data/shard-00007.bin")
if fault == "helper" and rank == 0:
    helper()
    time.sleep(1.0)  # the run goes on a while
last = time.monotonic()
for step in range(1, at["end_profile_step"] + 1):
    if fault == "sigstop":
        if step == 2 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        barrier(step)
    if fault == "quiet":  # no output at all: only the probe's stream grows
        time.sleep(0.8)
        now = time.monotonic()
        with open(os.path.join(os.environ["PYTHON_ZEROTUNE_PROBE_DIR"], f"probe.rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "step": step, "t": now, "step_s": now - last,
                                "train_batch_size": mbs * world}) + "\n")
        last = now
        continue
    print(f"step {step}", flush=True)
    time.sleep(0.05)
if rank == 0:
    with open(at["metric_path"] + ".tmp", "w") as f:
        json.dump({"throughput": 100.0 * mbs / (1 + 0.25 * stage), "latency": 1e4 * (1 + 0.25 * stage) / mbs,
                   "FLOPS_per_gpu": 1e9}, f)
    os.replace(at["metric_path"] + ".tmp", at["metric_path"])
'''

# the stand-ins' driver, with the default timeout's constants set from the environment (a test
# cannot wait the real floor): the rule under test is the same, at a scale a test can wait for
TIMEOUT_DRIVER = DRIVER.replace("from zerotune import cli\n", """from zerotune import cli
try:
    import zerotune.run.backends.timeout as timeout
    for name in ("DEFAULT_TIMEOUT_FLOOR_S", "UNKNOWN_STARTUP_TIMEOUT_S"):
        if os.environ.get("STANDIN_" + name):
            setattr(timeout, name, float(os.environ["STANDIN_" + name]))
except ImportError:
    pass
""", 1)

TARGET = "z0_gas1_tmbspg1"  # the fault hits z0 at mbs 1, never the winner
TUNER_WAIT_S = 90  # a tuning here takes seconds; longer is a hung tuner


def make_work(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in (("rank.py", RANK), ("launcher.py", LAUNCHER), ("driver.py", TIMEOUT_DRIVER)):
        (path / name).write_text(text)
    (path / "ds.json").write_text(json.dumps(BASE_CONFIG))
    return path


def untimed_argv(work: Path, *extra: str, ranks: int = 2) -> list[str]:
    """:func:`benchmarks.faults.standins.tune_argv` without its ``--timeout 30``: the default timeout applies."""
    argv = tune_argv(work, *extra, ranks=ranks)
    i = argv.index("--timeout")
    return argv[:i] + argv[i + 2:]


def tune(work: Path, argv: list[str], plan: dict, **env) -> dict:
    """Run the real CLI; the report of :func:`matrix_cases` so far, with the run's facts."""
    tuner = start_tuner(work, argv, plan, **env)
    why = []
    try:
        _, err = tuner.communicate(timeout=TUNER_WAIT_S)
    except subprocess.TimeoutExpired:
        why.append(f"the tuner hung: killed after {TUNER_WAIT_S} s")
        os.killpg(tuner.pid, signal.SIGKILL)
        _, err = tuner.communicate()
    left = leftovers(work, tuner.pid)
    return {"why": why, "lost": [], "left": left, "tracebacks": re.findall(r"Traceback[^\n]*\n(?:.*\n){0,6}", err),
            "code": tuner.returncode, "err": err}


def leftovers(work: Path, tuner_pid: int) -> list[str]:
    """The processes of this case still alive (stand-ins, the run token's, the helpers): described, then
    killed, so that a failing case leaves nothing on the machine."""
    procs = {p.pid: p for p in stand_in_processes(work) + processes_of_tuner(tuner_pid)}
    for path in (work / "results" / "exps").glob("*/helper.pid"):
        try:
            p = psutil.Process(int(path.read_text()))
            if "stand-in-helper" in p.cmdline():
                procs[p.pid] = p
        except (psutil.Error, ValueError):
            pass
    left = []
    for p in procs.values():
        try:
            left.append(f"{p.pid}: {' '.join(p.cmdline())[-120:]}")
            p.kill()
        except psutil.Error:
            pass
    return left


def lost(results: Path, hit: str, finished: dict[str, str] | None = None) -> list[str]:
    """Experiments the fault did not hit (``hit``: a name substring) that did not end ok, and finished records
    changed or gone since ``finished`` (name -> exp.json's text)."""
    recs = records(results)
    out = [f"{n}: {r['status']} ({r['error']})" for n, r in recs.items() if hit not in n and r["status"] != "ok"]
    for name, text in (finished or {}).items():
        path = results / "exps" / name / "exp.json"
        if not path.exists() or path.read_text() != text:
            out.append(f"{name}: its finished record changed or went")
    return out


def expect(report: dict, ok: bool, why: str) -> None:
    if not ok:
        report["why"].append(why)


def tuned(report: dict, results: Path, status: str) -> dict:
    """Check that the tuning ended with the undisturbed answer and the target with ``status``; the target's
    record."""
    hit = next((r for n, r in records(results).items() if n.startswith(TARGET) and not n.endswith("_r2")), {})
    expect(report, report["code"] == 0, f"exit status {report['code']}: {report['err'][-500:]}")
    expect(report, hit.get("status") == status, f"{TARGET} is {hit.get('status')} ({hit.get('error')}), not {status}")
    if report["code"] == 0:
        expect(report, answer(results) == {"stage": ANSWER["stage"], "mbs": ANSWER["mbs"]},
               f"answer {answer(results)}, not the undisturbed one")
    return hit


def finish(report: dict, results: Path, hit: str = TARGET, finished: dict[str, str] | None = None) -> dict:
    """The matrix's report: ``report`` with the results lost, and a traceback counted as not survived."""
    report["lost"] += lost(results, hit, finished)
    if report["tracebacks"]:
        report["why"].append("a traceback on the tuner's stderr")
    if report["left"]:
        report["why"].append("processes outlived the tuning")
    return {key: report[key] for key in ("why", "lost", "left", "tracebacks")}


# --- the scenarios (each also a fault-matrix case) -------------------------------------------------


def false_oom(root: Path) -> dict:
    """A script prints "out of memory-mapped shards" then raises FileNotFoundError: FAILED with that error, the
    answer unchanged, and a rerun runs it again (a failure is not reused; a false OOM was)."""
    work = make_work(root / "false_oom")
    results = work / "results"
    report = tune(work, tune_argv(work, ranks=2), {TARGET: "false_oom"})
    hit = tuned(report, results, "failed")
    expect(report, "FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-00007.bin'"
           in (hit.get("error") or ""), f"{TARGET}'s error does not show the script's: {hit.get('error')!r}")
    finished = {p.parent.name: p.read_text() for p in (results / "exps").glob("*/exp.json")
                if json.loads(p.read_text())["status"] == "ok"}
    before = (results / "exps" / TARGET / "exp.json").read_text() if hit else ""
    again = tune(work, tune_argv(work, ranks=2), {TARGET: "false_oom"})
    expect(again, (results / "exps" / TARGET / "exp.json").read_text() != before,
           f"the rerun reused {TARGET}'s recorded {hit.get('status')} instead of running it again")
    for key in ("why", "left", "tracebacks"):
        report[key] += again[key]
    return finish(report, results, finished=finished)


def quiet_steps(root: Path) -> dict:
    """A run that prints nothing but records a step every 0.8 s is not hung under ``--hang-timeout 2``."""
    work = make_work(root / "quiet_steps")
    report = tune(work, tune_argv(work, "--hang-timeout", "2", ranks=2), {TARGET: "quiet"})
    hit = tuned(report, work / "results", "ok")
    expect(report, hit.get("metric_source") == "probe", f"{TARGET} not measured from its probe stream")
    return finish(report, work / "results")


def stopped_rank(root: Path) -> dict:
    """Without ``--timeout``: a rank SIGSTOPped at step 2 (its peer waits at the barrier) is killed at the default
    timeout, max(floor, 10 x the profile run's wall time), and the tuning ends with the undisturbed answer."""
    work = make_work(root / "stopped_rank")
    report = tune(work, untimed_argv(work), {TARGET: "sigstop"}, STANDIN_DEFAULT_TIMEOUT_FLOOR_S="3")
    hit = tuned(report, work / "results", "timeout")
    profile = next((r for r in records(work / "results").values() if r["kind"] == "profile"), {})
    limit = round(max(3.0, 10 * (profile.get("wall_s") or 0)), 1)
    expect(report, (hit.get("error") or "").startswith(f"killed after the {limit:g} s default timeout (10 x the "
                                                       f"profile run's {profile.get('wall_s')} s, at least 3 s"),
           f"{TARGET}'s error {hit.get('error')!r} does not name the default timeout of {limit:g} s")
    return finish(report, work / "results")


def stopped_profile(root: Path) -> dict:
    """Without ``--timeout``: a SIGSTOPped profile run is killed at the bound for an unknown start-up, and the
    tuning fails saying so (exit 1), with nothing left running."""
    work = make_work(root / "stopped_profile")
    report = tune(work, untimed_argv(work), {"profile": "sigstop"}, STANDIN_UNKNOWN_STARTUP_TIMEOUT_S="3")
    expect(report, report["code"] == 1, f"exit status {report['code']}, not 1: {report['err'][-500:]}")
    expect(report, "the profile run failed (timeout: killed after the 3 s timeout for a run whose start-up time "
           "is unknown" in report["err"], f"the tuner does not say the profile timed out: {report['err'][-500:]}")
    return finish(report, work / "results", hit="profile")


def orphaned_helper(root: Path) -> dict:
    """A daemon a rank starts (own session, cleared environment, double fork) is killed with its experiment."""
    work = make_work(root / "orphaned_helper")
    report = tune(work, tune_argv(work, ranks=2), {TARGET: "helper"})
    tuned(report, work / "results", "ok")
    expect(report, (work / "results" / "exps" / TARGET / "helper.pid").exists(), "the stand-in started no helper")
    return finish(report, work / "results")


def matrix_cases() -> list[tuple[str, str, Callable[[Path], dict]]]:
    """(kind, name, run) per case for benchmarks/fault_matrix.py: ``run(root)`` performs it end to end with the
    real CLI in a fresh directory under ``root`` and returns ``{"why", "lost", "left", "tracebacks"}``."""
    kind = "round two: runs"
    return [(kind, "log line says out of memory", false_oom), (kind, "quiet run steps", quiet_steps),
            (kind, "rank SIGSTOPped, no --timeout", stopped_rank),
            (kind, "profile SIGSTOPped, no --timeout", stopped_profile),
            (kind, "helper leaves env, group, tree", orphaned_helper)]
