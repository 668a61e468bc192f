"""The longest batch (issue 42): the predicted peak at the longest length against the peak of the answer's run with
every micro batch padded to it (``--verify-longest``), on real DeepSpeed with 2 CPU ranks.

Each case tunes ``benchmarks/train_hf_loop.py`` (a GPT-2 built from a config, micro batches of 32 tokens; the long
ones never come in the tuning's steps) at ZeRO-0 under a per-rank budget that binds at the longest length, with
``--max-seq-len L --verify-longest``, and prints, for each config checked, the measured peak at 32 tokens, the
prediction at ``L`` and, for the verified ones, the peak at ``L`` and the prediction's error. Run from the
repository root (about a minute a case)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.longest_batch [--cases 2x512,2x256,4x512]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_hf_loop.py"
BUDGETS = {(2, 512): "3.5GiB", (2, 256): "2.25GiB", (4, 512): "5GiB"}  # GiB per rank that binds at the longest
CHECK = re.compile(r"longest batch: (\S+): measured peak (.+?) at (\d+) tokens; at (\d+) tokens (.+?) predicted")
VERIFIED = re.compile(r"verified at the longest batch: (\S+)_longest\d+ .*?: (ran, peak (.+?) \(predicted .+?: "
                      r"([+-]\d+%)\)|.*)$")


def tune(layers: int, longest: int, budget: str, workdir: Path) -> list[str]:
    """One tuning's notes on the longest batch."""
    config = workdir / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0], "reduce_bucket_size": 50_000_000},
        "autotuning": {"start_profile_step": 2, "end_profile_step": 5, "max_train_micro_batch_size_per_gpu": 64,
                       "num_tuning_micro_batch_sizes": 1, "fast": True}}))
    results = workdir / "results"
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", budget,
                           "--precision", "0.005", "--max-seq-len", str(longest), "--verify-longest",
                           "--results-dir", str(results), str(SCRIPT), "--n-layer", str(layers), "--n-embd", "64",
                           "--n-head", "2", "--vocab", "8192", "--seq-len", "32", "--long-seq-len", str(longest),
                           "--long-every", "100000", "--step-wait", "0.1", "--steps", "8",
                           "--deepspeed_config", str(config)], cwd=workdir, capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"the tuning failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [n for n in json.loads((results / "results.json").read_text())["tuning"]["notes"] if "longest" in n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2x512,2x256,4x512", help="LAYERSxLONGEST, comma-separated, of "
                                                                     f"{[f'{a}x{b}' for a, b in BUDGETS]}")
    args = parser.parse_args()
    print("| layers | longest | budget | config | peak at 32 tokens | predicted | verified | error |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        layers, longest = (int(x) for x in case.split("x"))
        budget = BUDGETS[(layers, longest)]
        with tempfile.TemporaryDirectory() as tmp:
            notes = tune(layers, longest, budget, Path(tmp))
        verified = {m.group(1): (m.group(3) or m.group(2)[:40], m.group(4) or "") for n in notes
                    if (m := VERIFIED.search(n))}
        for note in notes:
            if m := CHECK.search(note):
                peak, error = verified.get(m.group(1), ("", ""))
                print(f"| {layers} | {longest} | {budget} | {m.group(1)} | {m.group(2)} | {m.group(5)} | {peak} | "
                      f"{error} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
