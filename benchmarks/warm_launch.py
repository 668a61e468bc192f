"""What a launch costs, cold against warm: the same experiment run through DeepSpeed's launcher and forked from a
warm rank server (:mod:`zerotune.run.warm`), interleaved A B A B, on 2 CPU ranks.

Two scripts, each with one fixed config (no search, so both modes run exactly the same thing):

- ``examples/train_gpt.py`` (the demo's GPT, default size), ZeRO stage 1, mbs 8, to ``end_profile_step`` 6;
- ``examples/train_hf.py``, a Hugging Face ``Trainer`` GPT-2 built from a config: a whole tuning (ZeRO-1, mbs 2-8,
  the Trainer's ``"auto"`` values resolved by zerotune as for a user), ``--cold-launch`` against warm, per launch.

Each fixed run goes through zerotune's own scheduler and local backend (``LaunchSpec.warm`` True or False), so its
figures are the experiment record's: ``startup_s`` (launch to the start of the first step), ``measure_s`` (first step's
start to the last step's end), ``wall_s``, the probe's metric (samples/s) and the peak ``VmData`` per rank. The warm
server is started once per script and mode (its preload is reported apart: a tuning pays it once).

    OMP_NUM_THREADS=1 python -m benchmarks.warm_launch [--rounds 3] [--only gpt|hf]

Prints one table per script and writes benchmarks/results/warm_launch.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 11 * 2**30  # per rank: binds nothing here


def cases(tmp: Path) -> dict[str, tuple[str, list[str], dict]]:
    """name -> (script, its arguments, the experiment's ds_config), for the fixed-config runs."""
    gpt = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "zero_optimization": {"stage": 1}}
    return {"gpt": (str(ROOT / "examples" / "train_gpt.py"), ["--steps", "40"], gpt)}


HF_ARGS = ["--n_layer", "2", "--n_embd", "128", "--seq_len", "64", "--output_dir", "out", "--max_steps", "40",
           "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
           "--per_device_train_batch_size", "2", "--deepspeed", "ds.json"]


def hf_tuning(tmp: Path, warm: bool) -> dict:
    """One real tuning of ``examples/train_hf.py`` (ZeRO-1, mbs 2..8): the figures of its launches' records."""
    work = tmp / f"hf_{'warm' if warm else 'cold'}_{time.monotonic_ns()}"
    work.mkdir()
    config = json.loads((ROOT / "examples" / "ds_config_hf.json").read_text())
    config["zero_optimization"]["stage"] = 1
    config["autotuning"].update(start_profile_step=3, end_profile_step=6, min_train_micro_batch_size_per_gpu=2,
                                max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=2)
    (work / "ds.json").write_text(json.dumps(config))
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "11GiB",
                          "--results-dir", "results", "--timeout", "600", *([] if warm else ["--cold-launch"]),
                          str(ROOT / "examples" / "train_hf.py"), *HF_ARGS], cwd=work, capture_output=True,
                         text=True, timeout=1800)
    if run.returncode != 0:
        sys.exit(f"hf tuning ({'warm' if warm else 'cold'}) failed:\n{run.stderr[-3000:]}")
    exps = [json.loads(p.read_text()) for p in sorted((work / "results" / "exps").glob("*/exp.json"))]
    ran = [e for e in exps if e.get("startup_s") is not None]
    return {"tuning_wall_s": round(time.monotonic() - started, 1), "launches": len(exps),
            "startup_s": [e["startup_s"] for e in ran], "wall_s": [e["wall_s"] for e in ran],
            "launch": sorted({e["launch"] for e in exps})}


def run_case(name: str, script: str, args: list[str], ds_config: dict, rounds: int, tmp: Path) -> dict:
    """``rounds`` of (cold, warm) runs of one config; the records' figures per mode."""
    config_arg = "--deepspeed_config"
    (tmp / f"{name}.json").write_text(json.dumps(ds_config))
    backends, schedulers = {}, {}
    for mode in ("cold", "warm"):
        spec = LaunchSpec(script=script, script_args=(*args, config_arg, str(tmp / f"{name}.json")), cpu=True,
                          device_memory_bytes=BUDGET, start_profile_step=3, end_profile_step=6, timeout_s=600,
                          warm=mode == "warm")
        backends[mode] = LocalBackend(spec)
        schedulers[mode] = Scheduler(backends[mode], SlotPool(select_resources(local_slots=2)),
                                     tmp / f"{name}_{mode}_exps")
    runs: dict[str, list[Experiment]] = {"cold": [], "warm": []}
    for r in range(rounds):
        for mode in ("cold", "warm"):
            exp = Experiment(f"{name}_{mode}_{r}", dict(ds_config), num_slots=2)
            (done,) = schedulers[mode].run([exp])
            if done.status is None or done.status.value != "ok":
                log = (tmp / f"{name}_{mode}_exps" / exp.name / "stderr.log").read_text(errors="replace")
                sys.exit(f"{name} {mode} round {r}: {done.status} {done.error}\n{log[-3000:]}")
            runs[mode].append(done)
            print(f"  {name} {mode} {r}: wall {done.wall_s:.2f} s, start-up {done.startup_s:.2f} s, "
                  f"measuring {done.measure_s:.2f} s, {done.metric:.2f} samples/s, peak "
                  f"{done.peak_memory_bytes / 2**20:.0f} MiB ({done.launch})", flush=True)
    for backend in backends.values():
        backend.close()
    return {mode: {"wall_s": [e.wall_s for e in exps], "startup_s": [e.startup_s for e in exps],
                   "measure_s": [e.measure_s for e in exps], "samples_per_s": [e.metric for e in exps],
                   "peak_bytes": [e.peak_memory_bytes for e in exps], "launch": [e.launch for e in exps]}
            for mode, exps in runs.items()}


def report(name: str, figures: dict) -> None:
    med = {mode: {k: statistics.median(v) for k, v in f.items() if k != "launch"} for mode, f in figures.items()}
    cold, warm = med["cold"], med["warm"]
    print(f"{name}: median over {len(figures['cold']['wall_s'])} runs each, cold -> warm")
    print(f"  start-up per launch  {cold['startup_s']:6.2f} s -> {warm['startup_s']:6.2f} s  "
          f"({warm['startup_s'] / cold['startup_s']:.2f}x; target <= 0.35x)")
    print(f"  wall per launch      {cold['wall_s']:6.2f} s -> {warm['wall_s']:6.2f} s  "
          f"({warm['wall_s'] / cold['wall_s']:.2f}x)")
    print(f"  measuring            {cold['measure_s']:6.2f} s -> {warm['measure_s']:6.2f} s")
    spread = {m: (min(f["samples_per_s"]), max(f["samples_per_s"])) for m, f in figures.items()}
    print(f"  samples/s            {cold['samples_per_s']:6.2f} -> {warm['samples_per_s']:6.2f}  "
          f"(cold {spread['cold'][0]:.2f}-{spread['cold'][1]:.2f}, warm {spread['warm'][0]:.2f}-{spread['warm'][1]:.2f})")
    print(f"  peak VmData per rank {cold['peak_bytes'] / 2**20:6.0f} MiB -> {warm['peak_bytes'] / 2**20:6.0f} MiB  "
          f"({warm['peak_bytes'] / cold['peak_bytes'] - 1:+.1%}; target within 5%)")


def report_tunings(name: str, figures: dict[str, list[dict]]) -> None:
    per = {mode: statistics.median(s for f in runs for s in f["startup_s"]) for mode, runs in figures.items()}
    walls = {mode: statistics.median(f["tuning_wall_s"] for f in runs) for mode, runs in figures.items()}
    launch = {mode: statistics.median(s for f in runs for s in f["wall_s"]) for mode, runs in figures.items()}
    print(f"{name}: real tunings, {len(figures['cold'])} each, cold -> warm (median over every launch)")
    print(f"  start-up per launch  {per['cold']:6.2f} s -> {per['warm']:6.2f} s  ({per['warm'] / per['cold']:.2f}x; "
          f"target <= 0.35x)")
    print(f"  wall per launch      {launch['cold']:6.2f} s -> {launch['warm']:6.2f} s  "
          f"({launch['warm'] / launch['cold']:.2f}x)")
    print(f"  tuning wall          {walls['cold']:6.1f} s -> {walls['warm']:6.1f} s  ({walls['warm'] / walls['cold']:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warm_launch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("gpt", "hf"), default=None)
    args = parser.parse_args(argv)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="zt-warm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for name, (script, script_args, ds_config) in cases(tmp).items():
            if args.only not in (None, name):
                continue
            started = time.monotonic()
            out[name] = run_case(name, script, script_args, ds_config, args.rounds, tmp)
            out[name]["bench_wall_s"] = round(time.monotonic() - started, 1)
            report(name, {m: out[name][m] for m in ("cold", "warm")})
        if args.only in (None, "hf"):
            out["hf"] = {}
            for r in range(args.rounds):
                for warm in (False, True):
                    fig = hf_tuning(tmp, warm)
                    out["hf"].setdefault("warm" if warm else "cold", []).append(fig)
                    print(f"  hf {'warm' if warm else 'cold'} {r}: tuning {fig['tuning_wall_s']} s, "
                          f"{fig['launches']} launches, start-up per launch {fig['startup_s']}", flush=True)
            report_tunings("hf", out["hf"])
    path = ROOT / "benchmarks" / "results" / "warm_launch.json"
    kept = json.loads(path.read_text()) if path.exists() else {}  # --only: the other case's figures stay
    kept.update({name: {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, **figures}
                 for name, figures in out.items()})
    path.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
