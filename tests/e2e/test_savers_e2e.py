"""End to end, real DeepSpeed on 2 CPU ranks: the memory savers (zerotune.strategy.savers) tried, chosen and
passed to the script, and an offloaded config run (on CPU ranks the host is the rank: the run, not the saving)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.deepspeed.extensions import built_here, default_root
from zerotune.deepspeed.launcher import MIMALLOC_RESERVE_ENV
from zerotune.deepspeed.validate import validate
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler

# serial: the probe paces its widening steps by time, so a neighbour's load moves which mbs run out of memory
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread_per_rank"), pytest.mark.serial]
ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--vocab", "512", "--seq-len", "32", "--d-model", "64", "--n-layer", "2", "--n-head", "2"]


def test_an_offloaded_config_zerotune_validates_runs_on_cpu_ranks(tmp_path):
    stage, offload = 3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    # torch's AdamW on the host partition ("torch_adam"): no CPU-Adam build, as zerotune's GPU checks run it
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000, **offload}}
    validate(ds_config, 2)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    spec = LaunchSpec(script=GPT, script_args=tuple(TINY + ["--steps", "5", "--deepspeed_config", str(tmp_path / "ds.json")]),
                      cpu=True, device_memory_bytes=3 * 2**30, start_profile_step=2, end_profile_step=3, timeout_s=300)
    pool = SlotPool(select_resources(local_slots=2))
    exp = Experiment(f"z{stage}_offloaded", ds_config, num_slots=2)
    (done,) = Scheduler(LocalBackend(spec), pool, tmp_path / "exps").run([exp])
    logs = "".join((tmp_path / "exps" / exp.name / f).read_text() for f in ("stdout.log", "stderr.log"))
    assert done.status == Status.OK, (done.error, logs[-3000:])
    assert done.metric > 0 and pool.free_slots == 2
    # the engine's own optimizer offloaded (the probe's record of what the engine runs with, not of the config)
    engine = json.loads((tmp_path / "exps" / exp.name / "engine_config.json").read_text())
    assert (engine["offload_optimizer"], engine["offload_param"]) == (True, True)


HF = str(ROOT / "examples" / "train_hf.py")
# 67M parameters, 64M of them position embeddings (an optimizer step and a gradient all-reduce of 268 MB, no work per
# sample), 12 layers whose attention saves ~103 MiB per sample, ~9 MiB with checkpointing (the probe's price)
MODEL = ["--n_layer", "12", "--n_embd", "32", "--n_head", "8", "--seq_len", "256", "--n_positions", "2097152",
         "--vocab_size", "256", "--num_samples", "4096"]
TRAINER = ["--output_dir", "out", "--max_steps", "6", "--report_to", "none", "--save_strategy", "no",
           "--disable_tqdm", "true", "--per_device_train_batch_size", "1"]


@pytest.fixture(scope="module")
def built_ops():
    """DeepSpeed's CPU ops built by this install in the machine's cache (``make setup`` builds them there), from
    which each exps dir's cache is seeded: a rank that built one under a tight per-rank cap would run its compiler
    out of memory. Built here only where missing (a minute per op on 2 cores)."""
    if all(built_here(default_root() / op) for op in ("deepspeed_shm_comm", "fused_adam")):
        return
    subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import FusedAdamBuilder, "
                    "ShareMemCommBuilder; ShareMemCommBuilder().load(); FusedAdamBuilder().load()"],
                   env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="module")
def trainer_imports_mib() -> int:
    """``VmData`` (what the CPU ranks' budget limits) of a process after the example's imports, MiB: what each rank
    holds before any model, more where transformers' ``Trainer`` also imports ``datasets`` (with pandas, pyarrow)."""
    code = ("import deepspeed, transformers; from transformers import Trainer; "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmData')))")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", MIMALLOC_RESERVE_ENV: "0"}  # as ranks run
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=300)
    return int(out.stdout.split()[-1]) // 1024


def tune_trainer(tmp_path: Path, budget: str, max_mbs: int) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    config = json.loads((ROOT / "examples" / "ds_config_hf.json").read_text())
    config["zero_optimization"]["stage"] = 1
    config["autotuning"].update(start_profile_step=2, end_profile_step=4, max_train_micro_batch_size_per_gpu=max_mbs,
                                num_tuning_micro_batch_sizes=1, max_train_batch_size=2 * max_mbs)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", budget,
                           "--results-dir", str(results), "--timeout", "300", HF, *MODEL, *TRAINER,
                           "--deepspeed", "ds.json"], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    records = [json.loads(p.read_text()) for p in sorted((results / "exps").glob("*/exp.json"))]
    return proc, results, records


def engine_of(results: Path, record: dict) -> dict:
    return json.loads((results / "exps" / record["name"] / "engine_config.json").read_text())


def test_where_only_mbs_1_2_fit_checkpointing_runs_its_larger_mbs_and_is_chosen(tmp_path, built_ops,
                                                                                  trainer_imports_mib):
    # the imports (361 MiB without datasets, 429 with) + 1540 MiB: the engine, ZeRO-1's buffers, mbs 1-2's activations
    proc, results, records = tune_trainer(tmp_path, f"{trainer_imports_mib + 1540}MiB", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [r for r in records if r["kind"] != "profile"]
    plain = [r for r in runs if "gradient_checkpointing" not in r["ds_config"]]
    checkpointed = [r for r in runs if r["ds_config"].get("gradient_checkpointing") is True]
    # without checkpointing only mbs 1-2 run under the budget; the probe priced checkpointing, so the savers phase
    # ran the checkpointed configs at a larger mbs, each passing --gradient_checkpointing True to the Trainer
    assert max(r["ds_config"]["train_micro_batch_size_per_gpu"] for r in plain if r["status"] == "ok") <= 2
    ok = [r for r in checkpointed if r["status"] == "ok"]
    assert ok and max(r["ds_config"]["train_micro_batch_size_per_gpu"] for r in ok) > 2
    for r in runs:
        on = r in checkpointed
        cmd = (results / "exps" / r["name"] / "cmd.txt").read_text()
        assert ("--gradient_checkpointing True" in cmd) is on and cmd.count("--gradient_checkpointing") == int(on)
        if r["status"] == "ok":
            assert engine_of(results, r)["gradient_checkpointing"] is on  # the model really recomputed
    # no offload on CPU ranks: what it moves to the host stays in the rank
    assert not any("offload_optimizer" in json.dumps(r["ds_config"]) for r in runs)
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["gradient_checkpointing"] is True
    command = (results / "cmd_optimal.txt").read_text()
    assert command.count("--gradient_checkpointing True") == 1
    summary = (results / "summary.txt").read_text()
    assert "ZeRO stage 1 + checkpointing: explored - memory model: largest mbs" in summary
    assert "probe at mbs=" in summary and "beat the best" in summary

