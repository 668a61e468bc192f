"""The fault matrix: hostile inputs, rank faults, stop signals, a killed and resumed tuner, a full disk,
and round two's records, runs and inputs; how many zerotune survived, and what was lost, left behind or
printed as a traceback.

    OMP_NUM_THREADS=1 python -m benchmarks.fault_matrix [--json OUT]    # from the repository root

Every case runs the real ``zerotune`` CLI in its own process: the hostile inputs as
``python -m zerotune tune ...`` (:data:`benchmarks.faults.fault_cases.HOSTILE_INPUTS`), the others through
the stand-ins' driver (:mod:`benchmarks.faults.standins`), which only swaps DeepSpeed's launcher for a stand-in that
starts stand-in ranks (so a case takes seconds, not minutes; the process tree, signals, result files and
``/dev/shm`` files are real). A case **survived** when the tuner ended with the expected exit status
and the expected outcome, with no traceback, no process of its run left (found by the run token in
the process environment, and by the stand-ins' paths), no ``/dev/shm`` file of its runs left, and no
finished result lost or changed. Round two's cases (``matrix_cases`` of benchmarks/faults/hostile_records.py,
hostile_runs.py and hostile_inputs.py) run the same checks with their tests' own code. Figures:

- cases tried / survived;
- results lost: finished (ok or oom) ``exp.json`` records that a later step changed or removed;
- processes left: processes of the case still alive after the tuner ended (for a SIGKILLed tuner,
  after the rerun that must reap them);
- tracebacks: tuner stderr containing ``Traceback``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.faults import (  # the cases and stand-ins the tests run too  # round two (issue 28)
    fault_cases,
    hostile_inputs,
    hostile_records,
    hostile_runs,
    processes,
    standins,
)

ROOT = Path(__file__).resolve().parents[1]


class Case:
    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name
        self.survived, self.lost, self.left, self.tracebacks, self.why = True, 0, 0, 0, []

    def fail(self, why: str) -> None:
        self.survived = False
        self.why.append(why)


def workdir(root: Path, name: str) -> Path:
    work = root / name
    work.mkdir()
    for file, text in (("rank.py", standins.RANK), ("launcher.py", standins.LAUNCHER), ("driver.py", standins.DRIVER)):
        (work / file).write_text(text)
    (work / "ds.json").write_text(json.dumps(standins.BASE_CONFIG))
    return work


def finished(results: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in (results / "exps").glob("*/exp.json")
            if json.loads(p.read_text()).get("status") in ("ok", "oom")}


def count_lost(before: dict[str, str], results: Path) -> int:
    return sum(1 for name, text in before.items()
               if not (results / "exps" / name / "exp.json").exists()
               or (results / "exps" / name / "exp.json").read_text() != text)


def settle_and_count(case: Case, work: Path, shm: set[str], pid: int | None) -> None:
    """Processes and /dev/shm files of the case still there (after a moment for exits to land)."""
    time.sleep(0.3)
    left = {p.pid for p in processes.stand_in_processes(work)}
    if pid is not None:
        left |= {p.pid for p in processes.processes_of_tuner(pid)}
    case.left += len(left)
    shm_left = processes.shm_left(work, shm)
    if left:
        case.fail(f"{len(left)} process(es) left")
    if shm_left:
        case.fail(f"/dev/shm left: {sorted(shm_left)}")
        for name in shm_left:  # clean up after ourselves
            Path("/dev/shm", name).unlink(missing_ok=True)


def hostile_input(root: Path, spec) -> Case:
    name, args, config, script, message = spec
    case = Case("hostile input", name)
    tmp = root / f"input-{name}"
    tmp.mkdir()
    argv = fault_cases.hostile_argv(tmp, args, config, script)
    proc = subprocess.run([sys.executable, "-m", "zerotune", *argv], cwd=tmp, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    case.tracebacks += "Traceback" in proc.stderr
    if proc.returncode != 2:
        case.fail(f"exit {proc.returncode}")
    if not re.search(message, proc.stderr):
        case.fail("message does not name it")
    if (tmp / "results" / "exps").exists():
        case.fail("something was created or launched")
    if "Traceback" in proc.stderr:
        case.fail("traceback")
    return case


def rank_fault(root: Path, spec) -> Case:
    fault, target, status, error, extra, env = spec
    case = Case("rank fault", fault)
    work = workdir(root, f"rank-{fault}")
    shm = processes.shm_files()
    proc = standins.start_tuner(work, standins.tune_argv(work, *extra, ranks=2), plan={target: fault}, **env)
    _, err = proc.communicate(timeout=300)
    case.tracebacks += "Traceback" in err
    recs = standins.records(work / "results")
    hit = [r for n, r in recs.items() if n.startswith(target) and not n.endswith("_r2")]
    if not hit or hit[0]["status"] != status or not re.search(error, hit[0]["error"] or ""):
        case.fail(f"outcome {[(r['status'], r['error']) for r in hit]}")
    if proc.returncode != 0 or standins.answer(work / "results") != {"stage": 0, "mbs": 2}:
        case.fail(f"exit {proc.returncode} or another answer")
    settle_and_count(case, work, shm, proc.pid)
    return case


def stop_signal(root: Path, sig: signal.Signals) -> Case:
    """The tuner stopped by ``sig`` while an experiment runs, then rerun: the rerun resumes."""
    case = Case("tuner stopped, resumed", sig.name)
    work = workdir(root, f"signal-{sig.name}")
    shm = processes.shm_files()
    exps = work / "results" / "exps"
    proc = standins.start_tuner(work, standins.tune_argv(work, ranks=2), plan={"z0_gas1_tmbspg1": "slow"},
                                STANDIN_SLOW_S="60")
    deadline = time.monotonic() + 120
    log = exps / "z0_gas1_tmbspg1" / "stdout.log"
    while not (log.exists() and "step 3" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    before = finished(work / "results")
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    case.tracebacks += "Traceback" in err
    expected = -sig if sig is signal.SIGKILL else 128 + sig
    if proc.returncode != expected:
        case.fail(f"exit {proc.returncode}, expected {expected}")
    if sig is not signal.SIGKILL:
        settle_and_count(case, work, shm, proc.pid)
    case.lost += count_lost(before, work / "results")
    # the rerun: resumes, reaps what a SIGKILLed tuner left, keeps every finished result
    rerun = standins.start_tuner(work, standins.tune_argv(work, ranks=2))
    _, err = rerun.communicate(timeout=300)
    case.tracebacks += "Traceback" in err
    case.lost += count_lost(before, work / "results")
    if rerun.returncode != 0 or standins.answer(work / "results") != {"stage": 0, "mbs": 2}:
        case.fail(f"rerun exit {rerun.returncode} or another answer")
    if case.lost:
        case.fail(f"{case.lost} finished result(s) lost or changed")
    settle_and_count(case, work, shm, proc.pid)
    return case


def run_stopped_while_training(root: Path) -> Case:
    """``zerotune run`` stopped by SIGTERM while the training it started runs."""
    case = Case("zerotune run stopped", "SIGTERM while training")
    work = workdir(root, "run-sigterm")
    shm = processes.shm_files()
    proc = standins.start_tuner(work, ["run", *standins.tune_argv(work, ranks=2)[1:]], STANDIN_TRAIN_S="60")
    deadline = time.monotonic() + 120
    while not [p for p in processes.stand_in_processes(work) if "ds_config_optimal.json" in " ".join(p.cmdline())] \
            and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)
    before = finished(work / "results")
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    case.tracebacks += "Traceback" in err
    if proc.returncode != 143:
        case.fail(f"exit {proc.returncode}")
    case.lost += count_lost(before, work / "results")
    settle_and_count(case, work, shm, None)
    return case


def full_disk(root: Path) -> Case:
    case = Case("results disk full", "RLIMIT_FSIZE 2 KiB")
    work = workdir(root, "disk")
    code, _, err = standins.run_tuner(work, standins.tune_argv(work))
    before = finished(work / "results")
    (work / "full.py").write_text("import resource, runpy, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                                  "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))\nsys.argv = sys.argv[1:]\n"
                                  "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cfg = json.loads((work / "ds.json").read_text())
    cfg["autotuning"]["max_train_micro_batch_size_per_gpu"] = 4
    (work / "ds.json").write_text(json.dumps(cfg))
    shm = processes.shm_files()
    proc = subprocess.run([sys.executable, str(work / "full.py"), str(work / "driver.py"), str(work / "launcher.py"),
                           *standins.tune_argv(work)], cwd=work, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    case.tracebacks += "Traceback" in proc.stderr
    if code != 0 or proc.returncode != 1 or "cannot write the results" not in proc.stderr:
        case.fail(f"exit {proc.returncode}")
    case.lost += count_lost(before, work / "results")
    if case.lost:
        case.fail("results lost")
    settle_and_count(case, work, shm, None)
    return case


def stale_lock(root: Path) -> Case:
    """A lock left by a killed build in the experiments' extension cache: the next experiment runs."""
    case = Case("stale extension lock", "killed mid-build, then a run")
    work = root / "lock"
    work.mkdir()
    import pytest
    try:
        fault_cases.stale_lock_is_named_then_removed(work)
    except (AssertionError, pytest.fail.Exception) as e:
        case.fail(str(e)[:200])
    settle_and_count(case, work, set(), None)
    return case


def round_two(root: Path, kind: str, name: str, run) -> Case:
    """A round-two case (benchmarks/faults/hostile_*.py ``matrix_cases``): ``run(root)`` plays it with the real CLI and
    reports what was not survived, the results lost, the processes left and the tracebacks (counts or lists)."""
    case = Case(kind, name)
    try:
        out = run(root)
    except Exception as e:  # the scenario's own harness failed: not survived, said
        out = {"why": [f"scenario error: {type(e).__name__}: {e}"]}

    def count(key: str) -> int:
        value = out.get(key, 0)
        return value if isinstance(value, int) else len(value)

    case.lost, case.left, case.tracebacks = count("lost"), count("left"), count("tracebacks")
    for why in out.get("why", []):
        case.fail(why)
    return case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the cases as JSON here")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    cases: list[Case] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotune-faults-") as d:
        root = Path(d)
        steps = ([lambda s=s: hostile_input(root, s) for s in fault_cases.HOSTILE_INPUTS]
                 + [lambda s=s: rank_fault(root, s) for s in fault_cases.RANK_FAULTS]
                 + [lambda s=s: stop_signal(root, s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                                signal.SIGKILL)]
                 + [lambda: run_stopped_while_training(root), lambda: full_disk(root), lambda: stale_lock(root)]
                 + [lambda c=c: round_two(root, *c) for module in (hostile_records, hostile_runs,
                                                                   hostile_inputs) for c in module.matrix_cases()])
        for step in steps:
            case = step()
            cases.append(case)
            mark = "ok  " if case.survived else "FAIL"
            print(f"{mark} {case.kind:24s} {case.name:28s} {'; '.join(case.why)}", flush=True)
    survived = sum(c.survived for c in cases)
    figures = {"cases tried": len(cases), "survived": survived, "survived %": round(100 * survived / len(cases), 1),
               "results lost": sum(c.lost for c in cases), "processes left": sum(c.left for c in cases),
               "tracebacks": sum(c.tracebacks for c in cases), "seconds": round(time.monotonic() - started)}
    print()
    for kind in dict.fromkeys(c.kind for c in cases):
        of = [c for c in cases if c.kind == kind]
        print(f"{kind:24s} {sum(c.survived for c in of)}/{len(of)} survived")
    print()
    print(" | ".join(figures))
    print(" | ".join(str(v) for v in figures.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "cases": [
            {"kind": c.kind, "name": c.name, "survived": c.survived, "why": c.why} for c in cases]}, indent=1) + "\n")
    return 0 if survived == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
