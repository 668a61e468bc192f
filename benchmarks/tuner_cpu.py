"""How much CPU the tuner itself takes while an experiment's steps are measured (issue 41's target: under 1% of a
core).

A real tuning through the CLI, as a user at a terminal runs it: ``examples/train_gpt.py`` (default size), ZeRO stage
1, mbs up to 16, 2 CPU ranks, warm launches, the live progress display (the tuner's output is a pseudo-terminal)
and ``report.html`` refreshed as experiments finish. This script samples the tuner process's CPU seconds every
0.1 s (psutil: user plus system time of all its threads: the backend's polling, the scheduler, the display, the
report; the warm server, the launchers and the ranks are other processes). For each measured experiment the
window runs from the end of its second optimizer step (the probe's own memory sampler in the ranks stops there,
docs/decisions.md D202) to its last recorded step, read from the probe's streams (the same monotonic clock); the
tuner's share in it is its CPU seconds over the window's seconds, interpolated at the window's ends.

    OMP_NUM_THREADS=1 python -m benchmarks.tuner_cpu

Prints each experiment's share and the share over all windows, and writes benchmarks/results/tuner_cpu.json.
"""
from __future__ import annotations

import bisect
import json
import os
import pty
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from zerotune.probe import read_streams

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "zero_optimization": {"stage": 1},
          "autotuning": {"start_profile_step": 3, "end_profile_step": 12, "max_train_micro_batch_size_per_gpu": 16,
                         "max_train_batch_size": 32}}
SAMPLE_S = 0.1


def tune(work: Path) -> list[tuple[float, float]]:
    """Run the tuning in ``work`` on a pseudo-terminal; the tuner's (monotonic time, CPU seconds) samples."""
    (work / "ds.json").write_text(json.dumps(CONFIG))
    cmd = [sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--cpu", "--device-memory", "11GiB",
           "--results-dir", str(work / "results"), str(ROOT / "examples" / "train_gpt.py"), "--steps", "40",
           "--deepspeed_config", str(work / "ds.json")]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "PYTHONPATH": os.pathsep.join(
                                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
    os.close(slave)
    drain = threading.Thread(target=_drain, args=(master,), daemon=True)  # a terminal reads what it is sent
    drain.start()
    me, samples = psutil.Process(proc.pid), []
    while proc.poll() is None:
        try:
            cpu = me.cpu_times()
            samples.append((time.monotonic(), cpu.user + cpu.system))
        except psutil.Error:
            break
        time.sleep(SAMPLE_S)
    if proc.wait() != 0:
        raise SystemExit(f"the tuning failed ({proc.returncode}): see {work / 'results'}")
    return samples


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def cpu_at(samples: list[tuple[float, float]], t: float) -> float:
    """The tuner's CPU seconds at monotonic time ``t``, interpolated between the samples around it."""
    times = [s[0] for s in samples]
    i = min(max(bisect.bisect_left(times, t), 1), len(samples) - 1)
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def windows(exps: Path) -> dict[str, tuple[float, float]]:
    """Experiment name -> (start, end) of its measured window (see the module doc), monotonic seconds."""
    out = {}
    for exp_dir in sorted(p for p in exps.iterdir() if p.is_dir()):
        records = [r for rs in read_streams(exp_dir).values() for r in rs if r.t is not None and r.step is not None]
        starts = [r.t for r in records if r.step == 2]
        if starts and max(r.t for r in records) > max(starts):
            out[exp_dir.name] = (max(starts), max(r.t for r in records))
    return out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zt-tuner-cpu-") as tmp:
        samples = tune(Path(tmp))
        spans = windows(Path(tmp) / "results" / "exps")
        rows = {name: (cpu_at(samples, b) - cpu_at(samples, a), b - a) for name, (a, b) in spans.items()}
    for name, (cpu, wall) in rows.items():
        print(f"{name:40s} window {wall:6.2f} s  tuner CPU {cpu * 1000:7.1f} ms  {cpu / wall:6.2%} of a core")
    total_cpu, total_wall = sum(c for c, _ in rows.values()), sum(w for _, w in rows.values())
    share = total_cpu / total_wall if total_wall else float("nan")
    print(f"over {len(rows)} measured windows ({total_wall:.1f} s): the tuner took {share:.2%} of a core "
          f"(target: under 1%)")
    path = ROOT / "benchmarks" / "results" / "tuner_cpu.json"
    path.write_text(json.dumps({"windows": {n: {"tuner_cpu_s": round(c, 4), "window_s": round(w, 3)}
                                            for n, (c, w) in rows.items()}, "share_of_a_core": share,
                                "load": os.getloadavg()}, indent=1) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
