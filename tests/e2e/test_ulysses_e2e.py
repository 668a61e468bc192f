"""Ulysses sequence parallelism on real DeepSpeed (2 CPU ranks, gloo): a script that takes it (DeepSpeed's
UlyssesSPAttentionHF in benchmarks/train_hf_loop.py) is tuned with its groups, and one that does not is stopped at
the profile, naming the key (docs/decisions.md, D336)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import SCRIPT, TINY, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread_per_rank")]

ROOT = Path(__file__).resolve().parents[2]
ULYSSES_SCRIPT = str(ROOT / "benchmarks" / "train_hf_loop.py")
LLAMA = ["--arch", "llama", "--n-layer", "1", "--n-embd", "64", "--n-head", "4", "--seq-len", "64", "--vocab", "512"]


def zerotune(*args, cwd):
    return subprocess.run([sys.executable, "-m", "zerotune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def ulysses_config(path: Path, sp, **autotuning) -> Path:
    write_config(path, max_train_micro_batch_size_per_gpu=2, **autotuning)
    data = json.loads(path.read_text())
    data["zero_optimization"] = {"stage": 1}
    data["sequence_parallel_size"] = sp
    path.write_text(json.dumps(data))
    return path


def test_a_ulysses_script_is_tuned_with_its_groups_and_one_without_stops_at_the_profile(tmp_path):
    results = tmp_path / "results"
    proc = zerotune("tune", "--num_gpus", "2", "--device-memory", "3GiB", "--results-dir", str(results),
                    ULYSSES_SCRIPT, *LLAMA, "--steps", "6", "--deepspeed_config",
                    str(ulysses_config(tmp_path / "ds.json", 2)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in (results / "exps").glob("*/exp.json")]
    assert records and all(r["status"] == "ok" and r["name"].endswith("_sp2") for r in records), records
    for r in records:  # the engine ran each with a group of 2, which counts as one replica of mbs x gas samples
        engine = json.loads((results / "exps" / r["name"] / "engine_config.json").read_text())
        assert engine["sequence_parallel_size"] == 2
        assert engine["train_batch_size"] == engine["train_micro_batch_size_per_gpu"] * engine[
            "gradient_accumulation_steps"]
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["sequence_parallel_size"] == 2

    # the tiny GPT script passes DeepSpeed no mpu: the profile, at the listed degree 2, is refused as bad input (exit
    # status 2, naming the file and key) and nothing else runs
    other = tmp_path / "other"
    proc = zerotune("tune", "--num_gpus", "2", "--device-memory", "3GiB", "--results-dir", str(other), SCRIPT, *TINY,
                    "--steps", "6", "--deepspeed_config", str(ulysses_config(tmp_path / "plain.json", [1, 2])),
                    cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"zerotune: error: {tmp_path / 'plain.json'}: sequence_parallel_size 2: the script's DeepSpeed engine ran "
            f"with a sequence-parallel group of 1: the script does not take Ulysses") in proc.stderr
    assert [p.parent.name for p in (other / "exps").glob("*/exp.json")] == ["profile_z1_gas1_tmbspg1_rbs1e7_sp2"]
