"""Search quality at scale on a SIMULATED cluster: zerotune vs DeepSpeed's autotuner.

Nothing here runs on a GPU or measures hardware. Each scenario (a model from 125M to 70B
parameters on 8 to 1024 simulated GPUs of 40 or 80 GB, on one of several interconnects) is an
analytic model of a DeepSpeed training step (``benchmarks/simcluster/model.py``: compute from
FLOPs and an mbs-dependent efficiency, ZeRO communication volumes, overlap, buckets, memory with
allocator overhead, OOM, seeded noise, a simulated duration per experiment).

Both tuners run unchanged against it, with the same simulated device memory, profile, metric
(throughput), micro-batch bounds (1..1024), ZeRO stages (all) and DeepSpeed's default
``fast: true`` (no knob phase):

- zerotune: ``zerotune.autotuner.Autotuner(..., backend=SimulatedBackend(sim))`` with
  ``TuneOptions(device_memory_bytes=<device memory>, cpu=False)`` on N hosts × 8 slots from a
  hostfile (``benchmarks/simcluster/backend.py``);
- DeepSpeed: ``deepspeed.autotuning.autotuner.Autotuner(args, active_resources).tune()`` with its
  experiment launch replaced by the simulator and ``get_accelerator().total_memory()`` returning
  the device memory (``benchmarks/simcluster/deepspeed_harness.py``).

Per scenario: the exhaustive optimum over the space both tuners search (ZeRO stage 0-3 × mbs
1..1024 at gradient_accumulation_steps 1, every other setting at DeepSpeed's default; configs a
tuner ran outside it, such as DeepSpeed's gas > 1, are included when they are better), then per
tuner the noise-free throughput of the config it chose as a fraction of the optimum, the
experiments it launched (the profile run included) and the SIMULATED GPU-hours they took
(duration × GPUs). Launches (experiments started: here every experiment, nothing is pruned into or reused
from a ledger) and the SIMULATED tuning time are set beside "the ideal" (``ideal_tuner``: the profile, one run
per ZeRO stage within the noise level of the best, one more where the optimum has gas > 1; D28).

Run from the repository root: ``.venv/bin/python -m benchmarks.simulated_cluster`` (under a minute; ``--only 1 5``
runs some; ``--seeds 6`` pools six noise draws per scenario, the first the pinned one: one draw's worst case is one
unlucky run); raw results go to ``benchmarks/results/simulated_cluster.json``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed runs in-process for its autotuner only: no device

from rich.console import Console  # noqa: E402

from benchmarks.simcluster.backend import LedgerEntry, SimulatedBackend  # noqa: E402
from benchmarks.simcluster.deepspeed_harness import run_deepspeed_autotuner  # noqa: E402
from benchmarks.simcluster.model import NOISE_LEVEL, WARMUP_STEP_FACTOR, GiB, Simulator, ZeroSettings  # noqa: E402
from benchmarks.simcluster.scenarios import SCENARIOS, Scenario  # noqa: E402
from zerotune.autotuner import Autotuner, TuneOptions  # noqa: E402
from zerotune.core.errors import TuningFailed  # noqa: E402
from zerotune.core.measure import pooled_metrics  # noqa: E402
from zerotune.run.resources import select_resources  # noqa: E402

MAX_MBS = 1024
LOSS_TOLERANCE = 0.005  # zerotune "loses" a scenario when DeepSpeed's pick is this much better

USER_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": "all"},
    "autotuning": {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 3,
                   "end_profile_step": 5, "min_train_micro_batch_size_per_gpu": 1,
                   "max_train_micro_batch_size_per_gpu": MAX_MBS},
}


def space_config(stage: int, mbs: int, gas: int = 1) -> dict[str, Any]:
    cfg = {k: v for k, v in USER_CONFIG.items() if k != "autotuning"}
    return {**cfg, "zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": gas}


def stage_optima(sim: Simulator) -> tuple[dict[int, tuple[dict[str, Any], float]], int]:
    """({stage: (its best config, noise-free samples/s)} for the stages where some mbs fits, configs that fit)."""
    bests: dict[int, tuple[dict[str, Any], float]] = {}
    fitting = 0
    for stage in range(4):
        for mbs in range(1, MAX_MBS + 1):
            value = sim.throughput(space_config(stage, mbs))
            if value is None:
                break  # memory grows with mbs
            fitting += 1
            if value > bests.get(stage, (None, 0.0))[1]:
                bests[stage] = (space_config(stage, mbs), value)
    return bests, fitting


def full_run_s(sim: Simulator, cfg: dict[str, Any]) -> float:
    """SIMULATED seconds of one noise-free run of ``cfg`` to ``end_profile_step`` (:meth:`Simulator.run`'s
    duration with every noise factor 1: start-up, the warm-up step, the profiled steps, the exit)."""
    latency = sim.step(cfg).latency_s
    return sim.startup_s() + latency * (WARMUP_STEP_FACTOR + sim.end_profile_step + 1)


def ideal_tuner(sim: Simulator, stage_bests: dict[int, tuple[dict[str, Any], float]], optimum_cfg: dict[str, Any],
                profile_s: float) -> dict[str, Any]:
    """The launches a tuner needs that knows every noise-free figure but cannot see through the noise (D28).

    ``launches = 1 + W + G``: the profile run; one run of the best config of each ZeRO stage that can win,
    W = the stages whose best noise-free throughput over the space (gas 1) is within the noise level of the
    space's best (``>= (1 - sigma) x best``, sigma the log-normal sigma of the run-to-run factor: one run
    cannot rank configs closer than that, so each must be measured; W >= 1); and G = 1 when the optimum
    (``optimum_cfg``) has gas > 1 (a config a tuner found beyond the space: one more run). No re-measure is
    counted: it is a lower bound, not a tuner. ``simulated_hours`` adds the noise-free durations of those
    runs (:func:`full_run_s`) to ``profile_s`` (zerotune's profile run).
    """
    threshold = (1 - sim.noise_level) * max(value for _, value in stage_bests.values())
    winning = sorted(s for s, (_, value) in stage_bests.items() if value >= threshold)
    gas = ZeroSettings.from_config(optimum_cfg).gas > 1
    runs = [stage_bests[s][0] for s in winning] + ([optimum_cfg] if gas else [])
    return {"launches": 1 + len(winning) + int(gas), "winning_stages": winning, "gas": gas,
            "threshold_fraction": 1 - sim.noise_level,
            "simulated_hours": (profile_s + sum(full_run_s(sim, cfg) for cfg in runs)) / 3600}


def describe(cfg: dict[str, Any] | None) -> str:
    if cfg is None:
        return "-"
    z = ZeroSettings.from_config(cfg)
    return f"z{z.stage}/mbs{z.mbs}" + (f"/gas{z.gas}" if z.gas != 1 else "")


def run_zerotune(sim: Simulator, workdir: Path, hosts: list[str]) -> dict[str, Any]:
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"{h} slots={sim.cluster.gpus_per_node}\n" for h in hosts))
    config_path = workdir / "zt_config.json"
    config_path.write_text(json.dumps(USER_CONFIG))
    nodes = select_resources(hostfile)
    backend = SimulatedBackend(sim, metric="throughput", start_profile_step=3, end_profile_step=5)
    options = TuneOptions(device_memory_bytes=sim.cluster.device.memory_bytes, results_dir=str(workdir / "zt_results"),
                          overwrite=True, cpu=False, hostfile=str(hostfile))
    tuner = Autotuner("simulated_train.py", ["--deepspeed_config", str(config_path)], nodes, options,
                      console=Console(file=io.StringIO()), backend=backend)
    backend.stop_rule = tuner.job.stop_rule  # adaptive experiments: the rule the job gives the local backend
    chosen, error = None, ""
    try:
        chosen = tuner.tune().ds_config
    except TuningFailed as e:
        error = str(e)
    decisions = {r.stage: f"{r.decision.value} ({r.reason})" for r in tuner.stage_results}
    # what the summary reports: the answer's metric pooled over its runs (a re-measured answer's first run alone
    # would carry the winner's curse the re-measure corrects)
    reported = pooled_metrics(tuner.scheduler.history)[tuner.best.name].value if tuner.best else None
    return {"chosen": chosen, "reported": reported, "ledger": backend.ledger,
            "decisions": decisions, "error": error, "bought_by": {e.name: e.bought_by for e in tuner.scheduler.history}}


def run_deepspeed(sim: Simulator, workdir: Path, hosts: list[str]) -> dict[str, Any]:
    chosen, reported, ledger, error = None, None, [], ""
    try:
        chosen, reported, ledger = run_deepspeed_autotuner(sim, USER_CONFIG, workdir, hosts, sim.cluster.gpus_per_node)
    except Exception as e:  # DeepSpeed's own code failing is a result too
        error = f"{type(e).__name__}: {e}"
    return {"chosen": chosen, "reported": reported, "ledger": ledger, "decisions": {}, "error": error}


def summarize_tuner(sim: Simulator, run: dict[str, Any], optimum: float) -> dict[str, Any]:
    ledger: list[LedgerEntry] = run["ledger"]
    true = sim.throughput(run["chosen"]) if run["chosen"] else None
    return {
        "chosen": describe(run["chosen"]),
        "chosen_config": {k: v for k, v in run["chosen"].items() if k != "autotuning"} if run["chosen"] else None,
        "reported_throughput": run["reported"],
        "true_throughput": true,
        "fraction": (true or 0.0) / optimum,
        "experiments": len(ledger),
        "oom": sum(e.status == "oom" for e in ledger),
        "gpu_hours": sum(e.gpu_hours for e in ledger),
        "simulated_hours": sum(e.duration_s for e in ledger) / 3600,
        "decisions": run["decisions"],
        "error": run["error"],
        "launches": [{"name": e.name, "config": describe(e.ds_config), "status": e.status,
                      "duration_s": round(e.duration_s, 1)}
                     | ({"bought_by": run["bought_by"].get(e.name, "")} if "bought_by" in run else {}) for e in ledger],
    }


SEED_STRIDE = 1000
"""``--seeds K`` runs each scenario with seeds ``seed + SEED_STRIDE * k``, k = 0..K-1 (k = 0: the pinned draw)."""


def run_scenario(sc: Scenario, tmp_root: str, noise_level: float = NOISE_LEVEL, seed_offset: int = 0) -> dict[str, Any]:
    sim = Simulator(sc.model, sc.cluster, seed=sc.seed + SEED_STRIDE * seed_offset, end_profile_step=5,
                    noise_level=noise_level)
    hosts = [f"sim-node-{i}" for i in range(sc.cluster.num_nodes)]
    stage_bests, fitting = stage_optima(sim)
    best_cfg, best_value = max(stage_bests.values(), key=lambda cv: cv[1])  # max keeps the lower stage on a tie
    with tempfile.TemporaryDirectory(dir=tmp_root) as zt_dir, tempfile.TemporaryDirectory(dir=tmp_root) as ds_dir:
        zt = run_zerotune(sim, Path(zt_dir), hosts)
        sim.reset_runs()  # DeepSpeed's first run of a config draws what zerotune's first run of it drew
        ds = run_deepspeed(sim, Path(ds_dir), hosts)
    # configs a tuner ran outside the space (DeepSpeed's gas > 1) count when they are better
    beyond = None
    for e in zt["ledger"] + ds["ledger"]:
        value = None if e.profile or e.status != "ok" else sim.throughput(e.ds_config)
        if value is not None and value > best_value:
            best_cfg, best_value, beyond = e.ds_config, value, e.name
    profile_s = next((e.duration_s for e in zt["ledger"] + ds["ledger"] if e.profile), sim.startup_s())
    ideal = ideal_tuner(sim, stage_bests, best_cfg, profile_s)
    zt_summary, ds_summary = summarize_tuner(sim, zt, best_value), summarize_tuner(sim, ds, best_value)
    c = sc.cluster
    return {
        "scenario": sc.name + (f" (seed +{seed_offset})" if seed_offset else ""), "model": sc.model.name,
        "num_params": sc.model.num_params,
        "gpus": c.num_gpus, "nodes": c.num_nodes, "device": c.device.name,
        "device_memory_gib": c.device.memory_bytes / GiB, "interconnect": c.interconnect.name,
        "seed": sc.seed + SEED_STRIDE * seed_offset,
        "optimum": {"config": describe(best_cfg), "stage": ZeroSettings.from_config(best_cfg).stage,
                    "mbs": ZeroSettings.from_config(best_cfg).mbs, "throughput": best_value,
                    "space_configs_that_fit": fitting,
                    "outside_space": beyond},
        "zerotune": zt_summary,
        "deepspeed": ds_summary,
        "ideal": ideal,
        # launches = experiments started (the profile counts; nothing is pruned or reused into a ledger here)
        "launches": {"zerotune": zt_summary["experiments"], "deepspeed": ds_summary["experiments"],
                     "ideal": ideal["launches"]},
    }


def why_below(sim_row: dict[str, Any]) -> str:
    """A one-line reason for zerotune's pick falling short of the optimum, from its own records."""
    z, opt = sim_row["zerotune"], sim_row["optimum"]
    if z["error"]:
        return f"zerotune failed: {z['error']}"
    zs, os_ = ZeroSettings.from_config(z["chosen_config"]), opt["stage"]
    if zs.stage != os_:
        decision = z["decisions"].get(os_, "not considered")
        if not decision.startswith("explored"):
            return f"the optimum's stage z{os_} was {decision}"
        return (f"z{os_} was explored too, but z{zs.stage}/mbs{zs.mbs} measured best on noisy measurements "
                f"({z['reported_throughput']:.4g} samples/s measured, {z['true_throughput']:.4g} true)")
    return (f"right stage; picked mbs {zs.mbs} (optimum {opt['mbs']}) on noisy measurements: it measured "
            f"{z['reported_throughput']:.4g} samples/s, true {z['true_throughput']:.4g}")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'#':>2} {'scenario (SIMULATED)':<44} {'optimum':<14} {'samples/s':>9} | "
            f"{'zerotune':<13} {'frac':>5} {'exps':>4} {'GPU-h':>7} | {'DeepSpeed':<14} {'frac':>5} {'exps':>4} {'GPU-h':>7}"
            f" | {'launches zt/DS/ideal':>20} {'hours zt/DS/ideal':>17}")
    print(head)
    print("-" * len(head))
    for i, r in enumerate(rows, 1):
        z, d = r["zerotune"], r["deepspeed"]
        n, ideal = r["launches"], r["ideal"]
        print(f"{i:>2} {r['scenario']:<44} {r['optimum']['config']:<14} {r['optimum']['throughput']:>9.1f} | "
              f"{z['chosen']:<13} {z['fraction']:>5.3f} {z['experiments']:>4} {z['gpu_hours']:>7.1f} | "
              f"{d['chosen']:<14} {d['fraction']:>5.3f} {d['experiments']:>4} {d['gpu_hours']:>7.1f} | "
              f"{n['zerotune']:>10}/{n['deepspeed']:>3}/{n['ideal']:<5} "
              f"{z['simulated_hours']:>5.2f}/{d['simulated_hours']:>5.2f}/{ideal['simulated_hours']:<5.2f}"
              + (f"  [DS error: {d['error'][:60]}]" if d["error"] else ""))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    zf = [r["zerotune"]["fraction"] for r in rows]
    df = [r["deepspeed"]["fraction"] for r in rows]
    ze = [r["zerotune"]["experiments"] for r in rows]
    de = [r["deepspeed"]["experiments"] for r in rows]
    zh = [r["zerotune"]["gpu_hours"] for r in rows]
    dh = [r["deepspeed"]["gpu_hours"] for r in rows]
    zt = [r["zerotune"]["simulated_hours"] for r in rows]
    dt = [r["deepspeed"]["simulated_hours"] for r in rows]
    losses = [r for r in rows if r["deepspeed"]["fraction"] - r["zerotune"]["fraction"] > LOSS_TOLERANCE]

    def report_error(tuner: str) -> dict[str, float | None]:
        """The tuner's reported metric for its answer against the answer's noise-free throughput (0.03: 3% over)."""
        errors = sorted(r[tuner]["reported_throughput"] / r[tuner]["true_throughput"] - 1 for r in rows
                        if r[tuner].get("reported_throughput") and r[tuner].get("true_throughput"))
        if not errors:
            return {"median": None, "worst": None}
        return {"median": statistics.median(errors), "worst": max(errors, key=abs)}

    costlier = [r for r in rows if r["zerotune"]["gpu_hours"] > r["deepspeed"]["gpu_hours"]]
    launches = {t: [r["launches"][t] for r in rows] for t in ("zerotune", "deepspeed", "ideal")}
    hours = {t: [r[t]["simulated_hours"] for r in rows] for t in ("zerotune", "deepspeed", "ideal")}
    return {
        "scenarios": len(rows),
        "zerotune_fraction_median": statistics.median(zf), "zerotune_fraction_worst": min(zf),
        "deepspeed_fraction_median": statistics.median(df), "deepspeed_fraction_worst": min(df),
        "zerotune_within_1pct": sum(f >= 0.99 for f in zf), "deepspeed_within_1pct": sum(f >= 0.99 for f in df),
        "experiments_total": {"zerotune": sum(ze), "deepspeed": sum(de), "ratio": ratio(sum(ze), sum(de))},
        "experiments_ratio_median": statistics.median(ratio(a, b) for a, b in zip(ze, de)),
        "gpu_hours_total": {"zerotune": sum(zh), "deepspeed": sum(dh), "ratio": ratio(sum(zh), sum(dh))},
        "gpu_hours_ratio_median": statistics.median(ratio(a, b) for a, b in zip(zh, dh)),
        "simulated_tuning_hours_total": {"zerotune": sum(zt), "deepspeed": sum(dt), "ratio": ratio(sum(zt), sum(dt))},
        "report_error": {"zerotune": report_error("zerotune"), "deepspeed": report_error("deepspeed")},
        "zerotune_loses": [r["scenario"] for r in losses],
        "zerotune_costlier": [r["scenario"] for r in costlier],
        # launches = experiments started (the profile included); the ideal's definition: ideal_tuner
        "launches_total": {t: sum(v) for t, v in launches.items()},
        "launches_median": {t: statistics.median(v) for t, v in launches.items()},
        "launches_ratio": {
            "zerotune_deepspeed": {"total": ratio(sum(launches["zerotune"]), sum(launches["deepspeed"])),
                                   "median": statistics.median(map(ratio, launches["zerotune"], launches["deepspeed"]))},
            "zerotune_ideal": {"total": ratio(sum(launches["zerotune"]), sum(launches["ideal"])),
                               "median": statistics.median(map(ratio, launches["zerotune"], launches["ideal"]))}},
        "simulated_tuning_hours_ideal_total": sum(hours["ideal"]),
        "simulated_tuning_hours_median": {t: statistics.median(v) for t, v in hours.items()},
    }


def print_summary(s: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"\nSUMMARY over {s['scenarios']} SIMULATED scenarios (fraction = noise-free throughput of the chosen "
          f"config / exhaustive optimum)")
    print(f"  zerotune:  median {s['zerotune_fraction_median']:.3f}, worst {s['zerotune_fraction_worst']:.3f}, "
          f"within 1% of the optimum in {s['zerotune_within_1pct']}/{s['scenarios']}")
    print(f"  DeepSpeed: median {s['deepspeed_fraction_median']:.3f}, worst {s['deepspeed_fraction_worst']:.3f}, "
          f"within 1% of the optimum in {s['deepspeed_within_1pct']}/{s['scenarios']}")
    e, h = s["experiments_total"], s["gpu_hours_total"]
    print(f"  experiments: zerotune {e['zerotune']}, DeepSpeed {e['deepspeed']}: ratio {e['ratio']:.2f} "
          f"(median per scenario {s['experiments_ratio_median']:.2f})")
    print(f"  SIMULATED GPU-hours: zerotune {h['zerotune']:.0f}, DeepSpeed {h['deepspeed']:.0f}: ratio "
          f"{h['ratio']:.2f} (median per scenario {s['gpu_hours_ratio_median']:.2f})")
    rep = s["report_error"]
    if rep["zerotune"]["median"] is not None and rep["deepspeed"]["median"] is not None:
        print(f"  reported metric of the answer against its noise-free throughput: zerotune median "
              f"{rep['zerotune']['median']:+.1%}, worst {rep['zerotune']['worst']:+.1%}; DeepSpeed median "
              f"{rep['deepspeed']['median']:+.1%}, worst {rep['deepspeed']['worst']:+.1%}")
    losses = [r for r in rows if r["scenario"] in s["zerotune_loses"]]
    t = s["simulated_tuning_hours_total"]
    print(f"  SIMULATED tuning time (experiments run one after another): zerotune {t['zerotune']:.1f} h, DeepSpeed "
          f"{t['deepspeed']:.1f} h: ratio {t['ratio']:.2f}")
    n, m, q = s["launches_total"], s["launches_median"], s["launches_ratio"]
    print(f"  launches (experiments started, the profile included): total zerotune {n['zerotune']}, DeepSpeed "
          f"{n['deepspeed']}, ideal {n['ideal']}; median {m['zerotune']:g}, {m['deepspeed']:g}, {m['ideal']:g}; "
          f"zerotune/DeepSpeed {q['zerotune_deepspeed']['total']:.2f} (median {q['zerotune_deepspeed']['median']:.2f}), "
          f"zerotune/ideal {q['zerotune_ideal']['total']:.2f} (median {q['zerotune_ideal']['median']:.2f})")
    hm = s["simulated_tuning_hours_median"]
    print(f"  SIMULATED tuning time of the ideal (profile + one noise-free run per stage within "
          f"{rows[0]['ideal']['threshold_fraction']:.2f} of the optimum + gas): {s['simulated_tuning_hours_ideal_total']:.1f} h; "
          f"median per scenario zerotune {hm['zerotune']:.2f} h, DeepSpeed {hm['deepspeed']:.2f} h, ideal {hm['ideal']:.2f} h")
    print(f"  zerotune below DeepSpeed by more than {LOSS_TOLERANCE:.1%}: {len(losses)} scenario(s)")
    for r in losses:
        z, d = r["zerotune"], r["deepspeed"]
        print(f"    {r['scenario']}: zerotune {z['chosen']} {z['fraction']:.3f} vs DeepSpeed {d['chosen']} "
              f"{d['fraction']:.3f}, optimum {r['optimum']['config']}")
        print(f"      why: {why_below(r)}")
    costlier = [r for r in rows if r["scenario"] in s["zerotune_costlier"]]
    print(f"  zerotune spent more SIMULATED GPU-hours than DeepSpeed: {len(costlier)} scenario(s)")
    for r in costlier:
        z, d = r["zerotune"], r["deepspeed"]
        explored = sum(v.startswith("explored") for v in z["decisions"].values())
        print(f"    {r['scenario']}: {z['experiments']} vs {d['experiments']} experiments, {z['gpu_hours']:.1f} vs "
              f"{d['gpu_hours']:.1f} GPU-h; zerotune explored {explored} stage(s) fully")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", type=int, nargs="*", help="scenario numbers (1-based) to run")
    ap.add_argument("--seeds", type=int, default=1,
                    help="noise draws per scenario (default 1, the pinned one); the summary pools them all")
    ap.add_argument("--noise", type=float, nargs="*", default=[0.01, 0.05],
                    help="noise levels: log-normal sigma of the run-to-run factor and the per-step jitter")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "simulated_cluster.json"))
    args = ap.parse_args()
    scenarios = [SCENARIOS[i - 1] for i in args.only] if args.only else SCENARIOS
    tmp_root = "/dev/shm" if Path("/dev/shm").is_dir() else None
    start = time.time()
    results = {}
    print("SIMULATED cluster benchmark: an analytic model of DeepSpeed training steps, NOT measurements.")
    for level in args.noise:
        rows = []
        for offset in range(args.seeds):
            for sc in scenarios:
                rows.append(run_scenario(sc, tmp_root, level, offset))
                print(f"  [{time.time() - start:6.1f}s] noise {level:.0%} {sc.name} seed +{offset}", file=sys.stderr)
        print(f"\n=== noise level {level:.0%} (run-to-run and per-step log-normal sigma) ===\n")
        print_table(rows)
        s = summary(rows)
        print_summary(s, rows)
        results[f"{level:g}"] = {"summary": s, "scenarios": rows}
    elapsed = time.time() - start
    print(f"\n{len(scenarios)} scenarios x {args.seeds} seed(s) x {len(args.noise)} noise levels in {elapsed:.0f} s (wall time of this run; "
          f"the GPU-hours above are SIMULATED)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": "SIMULATED", "noise_levels": results, "elapsed_s": elapsed,
                               "date": time.strftime("%Y-%m-%d")}, indent=1, default=str) + "\n")
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
