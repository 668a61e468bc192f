"""False refusals: launch the configs a tuning's memory model refused near the budget, and count those that fit.

A config the fitted memory model predicts over the per-rank budget is never launched (``not launched: predicted X
per rank, Y with the m% margin, over the B budget``, docs/decisions.md, D110). This benchmark checks that refusal on
real DeepSpeed: it reads those lines from a tuning's ``summary.txt`` (running the tuning first unless
``--results`` names a finished one), keeps the configs whose prediction with the margin is within ``--within`` (15%) of the
budget, and launches each once through zerotune's local backend on 2 CPU ranks under the same budget
(``RLIMIT_DATA``), with the probe. A refusal was false when the config ran ok: its peak stayed under the budget.
Issue 39's target: none, on the demo and on a Hugging Face GPT-2.

The configs are the tuning's base ``ds_config`` (its ``autotuning`` section left out) at the name's ZeRO stage,
mbs and gas (``z1_gas1_tmbspg6``), as the tuner builds an mbs experiment; a name with knobs is skipped. Run from the
repository root (the default is ``make demo``'s tuning, ~2 min, then ~15 s a launch)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.false_refusals
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.false_refusals --results demo_results
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.core.units import format_bytes, parse_bytes
from zerotune.run.backends.local import LocalBackend

ROOT = Path(__file__).resolve().parent.parent
RANKS = 2
DEMO = ["--device-memory", "2.5GiB", "--timeout", "300", "examples/train_gpt.py", "--steps", "40",
        "--deepspeed_config", "examples/ds_config.json"]
REFUSAL = re.compile(r"(z(\d)_gas(\d+)_tmbspg(\d+)): not launched: predicted ([\d.]+ \w+) per rank, ([\d.]+ \w+) "
                     r"with the [\d.]+% margin, over the ([\d.]+ \w+) budget")


def refusals(summary: str) -> list[dict]:
    """The refused configs a ``summary.txt`` lists, each once: name, stage, gas, mbs, predicted and guarded bytes,
    budget. The summary's table wraps its lines at spaces, so they are joined first."""
    text = " ".join(line.strip() for line in summary.splitlines())
    found = {}
    for m in REFUSAL.finditer(text):
        found.setdefault(m.group(1), {
            "name": m.group(1), "stage": int(m.group(2)), "gas": int(m.group(3)), "mbs": int(m.group(4)),
            "predicted_bytes": parse_bytes(m.group(5).replace(" ", "")),
            "guarded_bytes": parse_bytes(m.group(6).replace(" ", "")),
            "budget_bytes": parse_bytes(m.group(7).replace(" ", ""))})
    return list(found.values())


def config(base: dict, stage: int, mbs: int, gas: int) -> dict:
    """``base`` at ``stage``, ``mbs`` and ``gas`` on :data:`RANKS` ranks, without its ``autotuning`` section."""
    cfg = {k: v for k, v in base.items() if k != "autotuning"}
    cfg.update(train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas, train_batch_size=mbs * gas * RANKS)
    cfg["zero_optimization"] = {**(base.get("zero_optimization") or {}), "stage": stage}
    return cfg


def tune(results: Path, tune_args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", str(RANKS), "--results-dir",
                    str(results), *tune_args], cwd=ROOT, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="a tuning's results dir: read where it has a summary.txt, else "
                        "tuned into (default: a new temporary dir)")
    parser.add_argument("--within", type=float, default=0.15, help="relative distance above the budget to launch")
    parser.add_argument("tune_args", nargs="*", help="zerotune tune's arguments after --num_gpus and --results-dir "
                        "(default: make demo's); the script and --deepspeed_config among them give each launch's")
    args = parser.parse_args()
    tune_args = args.tune_args or DEMO
    results = args.results or Path(tempfile.mkdtemp(prefix="zerotune-false-refusals-"))
    if not (results / "summary.txt").exists():
        tune(results, tune_args)
    script = next(a for a in tune_args if a.endswith(".py"))
    rest = tune_args[tune_args.index(script) + 1:]
    ds_path = rest[rest.index("--deepspeed_config") + 1]
    base = json.loads((ROOT / ds_path).read_text())
    script_args = [a for i, a in enumerate(rest) if "--deepspeed_config" not in rest[max(0, i - 1):i + 1]]
    found = refusals((results / "summary.txt").read_text())
    near = [r for r in found if r["guarded_bytes"] <= (1 + args.within) * r["budget_bytes"]]
    print(f"{results}: {len(found)} refused, {len(near)} within {args.within:.0%} of the budget", flush=True)
    false = 0
    for r in near:
        spec = LaunchSpec(script=str(ROOT / script), script_args=(*script_args, "--deepspeed_config", "ds_config.json"),
                          cpu=True, device_memory_bytes=r["budget_bytes"], timeout_s=300, extra_env={"OMP_NUM_THREADS": "1"})
        exp = Experiment(r["name"], config(base, r["stage"], r["mbs"], r["gas"]), 1, RANKS)
        LocalBackend(spec).run(exp, Reservation((Node("localhost", tuple(range(RANKS))),)), results / "refused" / r["name"])
        ran = exp.status is not None and exp.status.value == "ok"
        false += ran
        print(f"  {r['name']}: predicted {format_bytes(r['predicted_bytes'])}, {format_bytes(r['guarded_bytes'])} with "
              f"the margin, budget {format_bytes(r['budget_bytes'])}: {exp.status.value if exp.status else '?'}, peak "
              f"{format_bytes(exp.peak_memory_bytes or 0)}" + (" - a false refusal" if ran else ""), flush=True)
    print(f"false refusals: {false} of {len(near)} launched ({len(found)} refused in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
