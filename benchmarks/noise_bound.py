"""What measuring more could buy on the SIMULATED clusters: the answer quality of brute re-measurement.

Nothing here runs on a GPU or measures hardware. It reads a ``simulated_cluster.py`` results file
and asks, per scenario and noise draw: had every config zerotune ran ok been measured ``n`` times
(fresh SIMULATED noise, the same simulator, full runs of ``end_profile_step`` steps with no early
stop) and the best mean of those runs been the answer, how good would the answer be, and at what
cost? The "visited" rows keep zerotune's own search coverage (the configs it ran); the "visited +
optimum" rows add the optimum where zerotune never ran it, the bound of a search that knows where
to look and only has to tell the configs apart. Each run's metric is zerotune's own
(:func:`zerotune.core.measure.measure` on the run's probe streams: slowest rank, warm-up cut).

Read it as the price of the worst-case target under noise: at 5% run-to-run noise (the level's
log-normal sigma, per run and per step), configs 3-6% apart are told apart only by many runs each,
and any tuner that judges a config on its own runs pays that. zerotune's row is its actual result
from the same file (adaptive runs, replicas only where the readings are close).

Run from the repository root: ``.venv/bin/python -m benchmarks.noise_bound [results.json] [--noise 0.05]
[--runs 1 2 3 5 10]`` (default ``benchmarks/results/simulated_cluster_seeds6.json``; about 10 s per noise level
per 216 outcomes).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks.simcluster.model import Simulator  # noqa: E402
from benchmarks.simcluster.scenarios import SCENARIOS  # noqa: E402
from benchmarks.simulated_cluster import SEED_STRIDE  # noqa: E402
from zerotune.core.measure import measure  # noqa: E402
from zerotune.core.objective import Objective  # noqa: E402

THROUGHPUT = Objective.named("throughput")
BOUND_SEED = 500_000
"""Added to a draw's seed for the re-measurements, so they draw noise of their own, not the tuners' runs'."""


def _key(config: str) -> tuple[int, int, int]:
    """``"z1/mbs39/gas2"`` (``describe`` in simulated_cluster.py) -> (ZeRO stage, mbs, gas)."""
    m = re.fullmatch(r"z(\d)/mbs(\d+)(?:/gas(\d+))?", config)
    if m is None:
        raise ValueError(f"config {config!r}: expected z<stage>/mbs<mbs>[/gas<gas>]")
    return int(m[1]), int(m[2]), int(m[3] or 1)


def _ds_config(base: dict[str, Any], key: tuple[int, int, int]) -> dict[str, Any]:
    stage, mbs, gas = key
    cfg = copy.deepcopy(base)
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = mbs, gas
    cfg.pop("train_batch_size", None)
    return cfg


def bound(row: dict[str, Any], noise: float, runs: int, with_optimum: bool) -> tuple[float, float]:
    """One scenario draw: (the answer's noise-free throughput over the optimum's, the SIMULATED GPU-hours
    of the re-measurements) when each config is measured ``runs`` times and the best mean wins."""
    name, offset = re.fullmatch(r"(.*?)(?: \(seed \+(\d+)\))?", row["scenario"]).groups()
    sc = next(s for s in SCENARIOS if s.name == name)
    sim = Simulator(sc.model, sc.cluster, seed=sc.seed + SEED_STRIDE * int(offset or 0) + BOUND_SEED + runs,
                    end_profile_step=5, noise_level=noise)
    keys = {_key(launch["config"]) for launch in row["zerotune"]["launches"]
            if launch["status"] == "ok" and not launch["name"].startswith("profile")}
    if with_optimum:
        keys.add(_key(row["optimum"]["config"]))
    base = row["zerotune"]["chosen_config"]
    best, hours = None, 0.0
    for key in sorted(keys):
        cfg = _ds_config(base, key)
        values = []
        for _ in range(runs):
            outcome = sim.run(cfg)
            hours += outcome.duration_s * sc.cluster.num_gpus / 3600
            if outcome.ok:
                values.append(measure(outcome.streams, THROUGHPUT).value)
        if values and (best is None or statistics.fmean(values) > best[0]):
            best = (statistics.fmean(values), cfg)
    return sim.throughput(best[1]) / row["optimum"]["throughput"], hours


def line(label: str, fractions: list[float], hours: float, ds_hours: float) -> str:
    return (f"{label:34s} {statistics.median(fractions):6.3f} {min(fractions):6.3f} "
            f"{sum(f >= 0.99 for f in fractions):5d} {sum(f < 0.97 for f in fractions):5d} "
            f"{sum(f < 0.95 for f in fractions):5d} {hours / ds_hours:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default=str(ROOT / "benchmarks/results/simulated_cluster_seeds6.json"))
    ap.add_argument("--noise", type=float, nargs="+", default=None, help="noise levels (default: all in the file)")
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 3, 5, 10])
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
    for level, block in data["noise_levels"].items():
        if args.noise is not None and not any(abs(float(level) - n) < 1e-9 for n in args.noise):
            continue
        rows = block["scenarios"]
        ds_hours = sum(r["deepspeed"]["gpu_hours"] for r in rows)
        print(f"\nSIMULATED, noise {float(level):.0%}, {len(rows)} outcomes ({args.results}): the answer over the optimum")
        print(f"{'':34s} {'median':>6s} {'worst':>6s} {'w1%':>5s} {'<0.97':>5s} {'<0.95':>5s} {'GPU-h/DS':>8s}")
        print(line("zerotune (actual)", [r["zerotune"]["fraction"] for r in rows],
                   sum(r["zerotune"]["gpu_hours"] for r in rows), ds_hours))
        print(line("DeepSpeed (actual)", [r["deepspeed"]["fraction"] for r in rows], ds_hours, ds_hours))
        for with_optimum in (False, True):
            for n in args.runs:
                out = [bound(r, float(level), n, with_optimum) for r in rows]
                label = f"{'visited + optimum' if with_optimum else 'visited'}, {n} run(s) each"
                print(line(label, [f for f, _ in out], sum(h for _, h in out), ds_hours))


if __name__ == "__main__":
    main()
