"""The tiny example: examples/train_gpt.py at its smallest (:data:`SCRIPT`, :data:`TINY`), the ds_configs the tests
tune it with, and the answer a tuning of it must give."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--vocab", "512", "--seq-len", "32", "--d-model", "64", "--n-layer", "2", "--n-head", "2"]
PARAMS = 5_289_472
ACTIVATIONS = 43_589_632  # bytes per sample


def write_config(path: Path, **autotuning) -> Path:
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": [0, 1], "reduce_bucket_size": 50_000_000},
           "autotuning": {"start_profile_step": 2, "end_profile_step": 3, "max_train_micro_batch_size_per_gpu": 8,
                          "num_tuning_micro_batch_sizes": 1, **autotuning}}
    path.write_text(json.dumps(cfg))
    return path


def write_dry_run_config(path: Path, *, fast=True, model_info=True, **zero) -> Path:
    """A ds_config whose ``autotuning.model_info`` (:data:`PARAMS`, :data:`ACTIVATIONS`) lets a dry run plan without
    a profile run (``model_info=False``: none given)."""
    autotuning = {"fast": fast, "max_train_micro_batch_size_per_gpu": 8}
    if model_info:
        autotuning["model_info"] = {"num_params": PARAMS, "activation_mem_per_gpu": ACTIVATIONS}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": [0, 1], "reduce_bucket_size": 20_000_000, **zero},
           "autotuning": autotuning}
    path.write_text(json.dumps(cfg))
    return path


def best_pooled(records: list[dict], precision: float = 0.02) -> dict:
    """The exp.json record the answer must be: the highest metric averaged over its runs (the record and its
    re-measurements, ``replica_of``), where a config within ``precision`` of it whose reading is known only to more
    than 3x the precision counts at its lower bound (docs/decisions.md, D321; the half-widths are zerotune's noise
    rule over the records). On CPU ranks the tie order's headroom never decides (no budget to read the capacity
    against)."""
    from zerotune.core.noise import mean_half_width, run_noise
    from zerotune.run.exprecord import ExpRecord

    exps = [ExpRecord.from_dict(r).experiment for r in records]
    sigma = run_noise(exps).sigma
    runs: dict[str, list[tuple[float, float | None]]] = {}
    for r in records:
        if r["status"] == "ok" and r["kind"] != "profile":
            runs.setdefault(r["replica_of"] or r["name"], []).append((r["metric"], r["metric_rel_half_width"]))
    mean = {n: sum(m for m, _ in v) / len(v) for n, v in runs.items()}
    top = max(mean, key=mean.get)

    def counted(name: str) -> float:
        half = mean_half_width([hw for _, hw in runs[name]], sigma)
        return mean[name] * (1 - half) if half > 3 * precision else mean[name]
    tied = [n for n in mean if abs(mean[n] / mean[top] - 1) < precision]
    best = max(tied, key=counted)
    return next(r for r in records if r["name"] == best)
