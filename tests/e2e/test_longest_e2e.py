"""The answer at the longest batch, on real DeepSpeed (2 CPU ranks, a Hugging Face GPT-2 built from a config): a
data set of mixed lengths whose long batches the tuning's few steps never meet, under a budget that binds there."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.run.processes import remove_shm_buffers

# serial: memory under a per-rank cap, paced by time as in test_savers_e2e
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread_per_rank"), pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "train_hf_loop.py")
# 2 layers of width 64, 8,192-token vocabulary; micro batches of 32 tokens, one in 100,000 of 512 (never in a tuning);
# 0.1 s a step besides (a data loader's time): the larger micro batch reads faster however loaded the cores are
MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--vocab", "8192", "--seq-len", "32",
         "--long-seq-len", "512", "--step-wait", "0.1"]
BUDGET = int(3.5 * 2 ** 30)
PORT = 29517


def train(config: dict, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    """Two optimizer steps of the plain training command with ``config``, its second micro batch 512 tokens long,
    every process held to the tuning's per-rank budget (``RLIMIT_DATA``, as zerotune holds its ranks)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(PORT), SCRIPT,
           *MODEL, "--long-every", "2", "--steps", "2", "--deepspeed_config", str(path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2"}
    try:
        return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (BUDGET, BUDGET)))
    finally:
        remove_shm_buffers(PORT)


def test_the_answer_trains_through_its_longest_batch_and_the_answer_without_the_rule_does_not(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0], "reduce_bucket_size": 50_000_000},
        "autotuning": {"start_profile_step": 2, "end_profile_step": 5, "max_train_micro_batch_size_per_gpu": 64,
                       "num_tuning_micro_batch_sizes": 1, "fast": True}}))
    results = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "3.5GiB",
                           "--precision", "0.005", "--max-seq-len", "512", "--verify-longest", "--results-dir",
                           str(results), SCRIPT, *MODEL, "--long-every", "100000", "--steps", "8",
                           "--deepspeed_config", str(cfg)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads((results / "results.json").read_text())
    notes = body["tuning"]["notes"]
    records = {r["name"]: r for r in body["experiments"]}
    excluded = [n.split(": ")[1] for n in notes if n.startswith("longest batch: z") and n.endswith(
        "not the answer: over the budget at the longest batch")]
    assert excluded, notes  # the configs the seen batches alone would have answered with
    without_rule = json.loads((results / "exps" / excluded[0] / "exp.json").read_text())
    assert without_rule["metric"] > records[body["answer"]]["metric"] and without_rule["max_seq_len_seen"] == 32
    verified = [n for n in notes if n.startswith("verified at the longest batch: ")]
    assert verified[-1].startswith(f"verified at the longest batch: {body['answer']}_longest512 ") and ": ran, peak" in \
        verified[-1], notes
    # read for its peak, never timed: the user's end_profile_step, not a measured run's extended exit
    longest = json.loads((results / "exps" / f"{body['answer']}_longest512" / "ds_config.json").read_text())
    assert longest["autotuning"]["end_profile_step"] == 5

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    ok = train(optimal, tmp_path, "answer")
    assert ok.returncode == 0 and "step 1 loss" in ok.stdout, ok.stderr[-3000:]
    config = {k: v for k, v in without_rule["ds_config"].items() if k != "autotuning"}
    oom = train(config, tmp_path, "without_rule")
    assert oom.returncode != 0 and "can't allocate memory" in oom.stderr + oom.stdout, oom.stderr[-3000:]
