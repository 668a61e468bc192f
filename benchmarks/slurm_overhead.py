"""What Slurm costs a tuning: the same tuning through the local backend and through ``--backend slurm``, A B A B.

The case: ``examples/train_gpt.py`` (tiny), ZeRO stage 1, mbs up to 2, 2 CPU ranks on one node, 6 steps: the profile
run and two experiments. Each tuning gets a fresh results dir; the Slurm one runs inside
``salloc -N1 --ntasks-per-node=2`` (.ci/slurm_up.sh's one-node cluster), so its wall includes the allocation. The
overhead per launch is the difference of the medians over ``--rounds`` of wall / launches (a tuning's launches
vary with the noise it meets). A bare step, ``srun`` of
``python -c pass`` on 2 tasks against the same two processes started directly, is timed too (median of 10).

With ``--two-node`` it also times the two-node cluster (.ci/twonode_up.sh, one rank per node): the Slurm backend
against DeepSpeed's own multi-node runner (pdsh over ssh, from a hostfile), the tuner on node 0.

Both backends launch warm by default (docs/decisions.md D303); each setting's Slurm tuning is also timed with
``--cold-launch``, A B A B, and every case reports the median start-up per launch (the records' ``startup_s``: launch
to the first step; the profile run, which stops in its first forward, has none).

    python -m benchmarks.slurm_overhead [--rounds 2] [--two-node]

Prints one line per case and writes benchmarks/results/slurm_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--vocab", "512", "--seq-len", "32", "--d-model", "64", "--n-layer", "2", "--n-head", "2", "--steps", "6"]
ON_NODE = str(ROOT / ".ci" / "on_node")
TWO_NODE_CONF = "/etc/zerotune-twonode/slurm.conf"


def config(path: Path) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000},
        "autotuning": {"start_profile_step": 2, "end_profile_step": 3, "max_train_micro_batch_size_per_gpu": 2,
                       "num_tuning_micro_batch_sizes": 1, "max_train_batch_size": 4}}))
    return path


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def tuning(prefix: list[str], backend: list[str], extra_env: dict[str, str]) -> tuple[float, int, list[float]]:
    """One tuning in a fresh dir: (wall seconds, launches, each launch's start-up seconds where recorded)."""
    with tempfile.TemporaryDirectory(prefix="zt-slurm-bench-") as tmp:
        cfg, results = config(Path(tmp) / "ds.json"), Path(tmp) / "results"
        cmd = [*prefix, sys.executable, "-m", "zerotune", "tune", *backend, "--cpu", "--device-memory", "3GiB",
               "--timeout", "240", "--results-dir", str(results), str(ROOT / "examples" / "train_gpt.py"), *TINY,
               "--deepspeed_config", str(cfg)]
        start = time.monotonic()
        run = subprocess.run(cmd, cwd=tmp, env=env(**extra_env), capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - start
        if run.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
        records = [json.loads(p.read_text()) for p in (results / "exps").glob("*/exp.json")]
        return wall, len(records), [r["startup_s"] for r in records if r.get("startup_s") is not None]


def bare_step(srun: list[str]) -> float:
    """Median seconds of 10 launches of ``python -c pass`` on 2 tasks: through ``srun`` (its command line) when
    given, else two processes started directly and waited for."""
    times = []
    for _ in range(10):
        start = time.monotonic()
        if srun:
            subprocess.run([*srun, sys.executable, "-c", "pass"], check=True, env=env())
        else:
            for p in [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]:
                p.wait()
        times.append(time.monotonic() - start)
    return statistics.median(times)


def compare(name: str, a: tuple, b: tuple, rounds: int) -> dict:
    """A B A B: ``a`` and ``b`` are (label, prefix, backend args, env); returns the medians and the overhead."""
    runs: dict[str, list[tuple[float, int, list[float]]]] = {a[0]: [], b[0]: []}
    for _ in range(rounds):
        for label, prefix, backend, extra in (a, b):
            runs[label].append(tuning(prefix, backend, extra))
    walls = {label: statistics.median(w for w, _, _ in r) for label, r in runs.items()}
    per = {label: statistics.median(w / n for w, n, _ in r) for label, r in runs.items()}  # s per launch
    launches = {label: [n for _, n, _ in r] for label, r in runs.items()}
    startup = {label: round(statistics.median([s for _, _, ss in r for s in ss] or [float("nan")]), 3)
               for label, r in runs.items()}
    per_launch = per[b[0]] - per[a[0]]
    print(f"{name}: {a[0]} {walls[a[0]]:.1f} s, {b[0]} {walls[b[0]]:.1f} s (medians of {rounds}; launches "
          f"{launches}); per launch {a[0]} {per[a[0]]:.2f} s, {b[0]} {per[b[0]]:.2f} s: {per_launch:+.2f} s; "
          f"start-up per launch {a[0]} {startup[a[0]]:.2f} s, {b[0]} {startup[b[0]]:.2f} s", flush=True)
    return {"case": name, "walls_s": {k: [round(w, 2) for w, _, _ in r] for k, r in runs.items()},
            "median_s": walls, "launches": launches, "median_s_per_launch": per,
            "overhead_per_launch_s": round(per_launch, 3), "median_startup_s": startup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--two-node", action="store_true", help="also time the two-node cluster (.ci/twonode_up.sh)")
    args = parser.parse_args(argv)
    out: dict = {"load_before": os.getloadavg()}
    direct, srun = bare_step([]), bare_step(["srun", "-N1", "-n2"])
    print(f"bare step of 2 tasks (python -c pass): direct {direct:.3f} s, srun {srun:.3f} s (medians of 10)")
    out["bare_step_s"] = {"direct": direct, "srun": srun}
    alloc = ["salloc", "-N1", "--ntasks-per-node=2", "-J", "zerotune-bench"]
    slurm = ["--backend", "slurm", "--num_gpus", "2"]
    out["one_node"] = compare("one node, 2 CPU ranks", ("local", [], ["--num_gpus", "2"], {}),
                              ("slurm", alloc, slurm, {}), args.rounds)
    out["one_node_warm"] = compare("Slurm, one node, 2 CPU ranks", ("cold", alloc, [*slurm, "--cold-launch"], {}),
                                   ("warm", alloc, slurm, {}), args.rounds)
    if args.two_node:
        with tempfile.NamedTemporaryFile("w", suffix=".hostfile", delete=False) as f:
            f.write("ztnode0 slots=1\nztnode1 slots=1\n")
        two = [ON_NODE, "0", "salloc", "-N2", "--ntasks-per-node=1", "-J", "zerotune-bench"]
        slurm, conf = ["--backend", "slurm", "--num_gpus", "1"], {"SLURM_CONF": TWO_NODE_CONF}
        out["two_node"] = compare("two nodes, 1 CPU rank each", ("pdsh", [ON_NODE, "0"], ["--hostfile", f.name], {}),
                                  ("slurm", two, slurm, conf), args.rounds)
        out["two_node_warm"] = compare("Slurm, two nodes, 1 CPU rank each",
                                       ("cold", two, [*slurm, "--cold-launch"], conf), ("warm", two, slurm, conf),
                                       args.rounds)
        os.unlink(f.name)
    out["load_after"] = os.getloadavg()
    path = ROOT / "benchmarks" / "results" / "slurm_overhead.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
