"""The scheduler's own overhead per experiment: time not spent inside the launched processes.

For N experiments, ``Scheduler.run`` takes a wall time W. The launched processes (the
``deepspeed`` launcher and its ranks) are alive during intervals [Popen start, process exit]; the
time covered by at least one such interval is the in-process time P. ``W - P`` is the time the
scheduler and backend spend with no launched process alive: queueing, reserving slots, writing
``exp.json``/``ds_config.json``, noticing the exit, killing stragglers, reading the metrics. It is
reported per experiment, and for the local backend split into ``LocalBackend.run``'s own time
before the launch and after the exit.

Cases:

- ``local sequential``: the real :class:`LocalBackend` and the real ``deepspeed`` launcher on CPU
  (``DS_ACCELERATOR=cpu``), a stand-in training script that writes DeepSpeed's ``metrics.json``
  and exits (the launcher itself takes seconds to start; that time is inside the processes), a
  pool of 1 slot, each experiment 1 slot: one at a time.
- ``local parallel``: the same on a pool of 2 slots: two at a time.
- ``trivial backend`` (pure scheduling, no process): a backend whose ``run`` sleeps 50 ms and
  counts that as the in-process time, so what remains is the scheduler alone (threads, slot
  reservation, ``exp.json`` writes with fsync, the results dict).

The exit time of a launched process is taken exactly (a thread blocked in
``os.waitid(..., WEXITED | WNOWAIT)``, which does not reap it), not when the backend polls.

Run from the repository root: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.scheduler_overhead`` (about
a minute on 2 cores; ``--n`` experiments per case).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.run.backends import local as local_mod
from zerotune.run.backends.base import Backend
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

# Writes the metrics.json DeepSpeed's engine would write (``autotuning.metric_path``) and exits.
STAND_IN = '''\
import json, sys
args = sys.argv[1:]
cfg = json.load(open(args[args.index("--deepspeed_config") + 1]))
with open(cfg["autotuning"]["metric_path"], "w") as f:
    json.dump({"throughput": 100.0, "latency": 10000.0, "FLOPS_per_gpu": 1e9}, f)
'''


class _Intervals:
    """Thread-safe list of [start, end] monotonic intervals."""

    def __init__(self):
        self.items: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self.lock:
            self.items.append((start, end))

    def covered(self) -> float:
        """Length of the union of the intervals, seconds."""
        total, cur_start, cur_end = 0.0, None, None
        for start, end in sorted(self.items):
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            total += cur_end - cur_start
        return total


_current = threading.local()  # the _TimedPopen started by this thread's backend.run


class _TimedPopen(subprocess.Popen):
    """``subprocess.Popen`` that records [just before fork, exit] of the launched process."""

    intervals: _Intervals

    def __init__(self, *args, **kwargs):
        self.t_start = time.monotonic()
        self.t_exit = None
        super().__init__(*args, **kwargs)
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()
        _current.popen = self

    def _watch(self) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # returns at exit; leaves it for poll()
        except ChildProcessError:  # reaped by poll() before this thread got to wait: exit time is late
            pass
        self.t_exit = time.monotonic()
        self.intervals.add(self.t_start, self.t_exit)


class _TimedLocalBackend(LocalBackend):
    """``LocalBackend`` that splits its own time: before the launch (config, reaping, port) and
    after the exit (noticing it, killing stragglers, reading metrics)."""

    def __init__(self, spec: LaunchSpec):
        super().__init__(spec)
        self.before: list[float] = []
        self.after: list[float] = []

    def run(self, exp, reservation, exp_dir):
        entered = time.monotonic()
        _current.popen = None
        try:
            return super().run(exp, reservation, exp_dir)
        finally:
            left = time.monotonic()
            popen = _current.popen
            popen.watcher.join()
            self.before.append(popen.t_start - entered)
            self.after.append(left - popen.t_exit)


class _SleepBackend(Backend):
    """No process at all: ``run`` sleeps ``seconds`` (counted as in-process) and reports OK."""

    def __init__(self, seconds: float, intervals: _Intervals):
        self.seconds, self.intervals = seconds, intervals

    def run(self, exp, reservation, exp_dir):
        start = time.monotonic()
        time.sleep(self.seconds)
        self.intervals.add(start, time.monotonic())
        exp.status, exp.metric, exp.wall_s = Status.OK, 1.0, self.seconds
        return exp


def _experiments(n: int, tag: str) -> list[Experiment]:
    return [Experiment(f"{tag}_{i}", {"train_micro_batch_size_per_gpu": i + 1, "train_batch_size": i + 1})
            for i in range(n)]


def run_case(name: str, backend: Backend, slots: int, n: int, intervals: _Intervals, work: Path,
             batch: int | None = None) -> dict:
    """Run ``n`` experiments of 1 slot on a pool of ``slots``, in batches of ``batch`` (default: one batch)."""
    scheduler = Scheduler(backend, SlotPool(select_resources(local_slots=slots)), work / name.replace(" ", "_"))
    exps = _experiments(n, name.split()[0])
    batch = batch or n
    start = time.monotonic()
    done = [e for i in range(0, n, batch) for e in scheduler.run(exps[i:i + batch])]
    wall = time.monotonic() - start
    bad = [(e.name, e.status, e.error) for e in done if e.status != Status.OK]
    if bad:
        raise SystemExit(f"{name}: experiments did not succeed: {bad}")
    inside = intervals.covered()
    row = {"case": name, "n": n, "at_once": slots, "wall": wall, "inside": inside,
           "overhead_per_exp": (wall - inside) / n, "before": None, "after": None}
    if isinstance(backend, _TimedLocalBackend):
        row["before"], row["after"] = sum(backend.before) / n, sum(backend.after) / n
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=6, help="experiments per case")
    parser.add_argument("--skip-local", action="store_true", help="only the trivial backend (no DeepSpeed)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="zt-overhead-") as tmp:
        work = Path(tmp)
        script = work / "stand_in.py"
        script.write_text(STAND_IN)
        config = work / "ds_config.json"
        config.write_text("{}")
        if not args.skip_local:
            spec = LaunchSpec(script=str(script), script_args=("--deepspeed_config", str(config)), cpu=True,
                              timeout_s=120)
            real_popen = local_mod.subprocess.Popen
            try:
                for name, slots in (("local sequential", 1), ("local parallel", 2)):
                    intervals = _Intervals()
                    _TimedPopen.intervals = intervals
                    local_mod.subprocess.Popen = _TimedPopen
                    rows.append(run_case(name, _TimedLocalBackend(spec), slots, args.n, intervals, work))
            finally:
                local_mod.subprocess.Popen = real_popen
        for name, slots, batch in (("trivial sequential", 1, None), ("trivial parallel", 2, None),
                                   ("trivial batches of 1", 1, 1), ("trivial batches of 2", 2, 2)):
            n = max(args.n, 20)
            intervals = _Intervals()
            rows.append(run_case(name, _SleepBackend(0.05, intervals), slots, n, intervals, work, batch))

    def opt(v):
        return "-" if v is None else f"{v:.3f}"

    print(f"{'case':<20} {'experiments':>11} {'at once':>7} {'wall s':>8} {'in-process s':>12} "
          f"{'overhead s/exp':>14} {'before launch':>13} {'after exit':>10}")
    for r in rows:
        print(f"{r['case']:<20} {r['n']:>11} {r['at_once']:>7} {r['wall']:>8.2f} {r['inside']:>12.2f} "
              f"{r['overhead_per_exp']:>14.3f} {opt(r['before']):>13} {opt(r['after']):>10}")
    print("local: real deepspeed launcher on CPU, stand-in script; in-process = union of [Popen, exit] intervals;\n"
          "  before launch / after exit: LocalBackend.run's own s per experiment before Popen and after the exit\n"
          "  (noticing the exit; killing the tree and token-carrying stragglers; shm buffers; reading metrics).\n"
          "trivial: a backend that sleeps 50 ms per experiment and launches nothing (pure scheduling overhead);\n"
          "'batches of k': one Scheduler.run call per k experiments, as the search hands them over.")


if __name__ == "__main__":
    main()
