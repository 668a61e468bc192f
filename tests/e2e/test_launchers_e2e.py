"""End to end: each script unchanged, tuned with ``-- <its usual command>`` on CPU ranks, each answer then trained
by ``cmd_optimal.txt``: a strict-argparse DeepSpeed script under torchrun (warm and cold), the Hugging Face Trainer
example under ``accelerate launch`` and torchrun, and a TRL ``SFTTrainer`` script under ``accelerate launch`` with
and without a LoRA adapter (one rank: Accelerate counts DeepSpeed's CPU ranks as one process, docs/decisions.md
D314)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults.processes import on_free_port
from zerotune.run.processes import remove_shm_buffers

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread_per_rank")]  # 2 ranks on 2 cores
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TORCHRUN_SCRIPT = str(ROOT / "examples" / "train_torchrun.py")
HF_SCRIPT = str(ROOT / "examples" / "train_hf.py")
TRL_SCRIPT = str(ROOT / "examples" / "train_trl.py")
TINY_GPT = ["--steps", "12", "--d-model", "64", "--n-layer", "2", "--seq-len", "64", "--vocab", "512"]
TINY_HF = ["--n_layer", "1", "--n_embd", "64", "--n_head", "2", "--seq_len", "32", "--vocab_size", "256",
           "--num_samples", "512", "--output_dir", "out", "--max_steps", "8", "--report_to", "none",
           "--save_strategy", "no", "--disable_tqdm", "true", "--log_level", "info", "--per_device_train_batch_size", "1"]
TRAINER_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                    "gradient_accumulation_steps": "--gradient_accumulation_steps"}
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: false
distributed_type: DEEPSPEED
machine_rank: 0
num_machines: 1
num_processes: {ranks}
use_cpu: false
"""


def tune(cwd: Path, options: list[str], command: list[str]) -> dict:
    """``zerotune tune OPTIONS -- COMMAND`` in ``cwd`` (results in ``cwd/results``): its records by name."""
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--results-dir", "results", "--timeout", "240",
                           *options, "--", *command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(p.read_text()) for p in sorted((cwd / "results" / "exps").glob("*/exp.json"))]
    assert records and all(r["status"] == "ok" for r in records), [(r["name"], r["error"]) for r in records]
    return {r["name"]: r for r in records}


def train(cwd: Path) -> subprocess.CompletedProcess:
    """Run ``cmd_optimal.txt`` as a person pastes it. Its launcher is named by path, as the tests type it: the ``PATH``
    stays the tests' own, since another ``ninja`` on it would rebuild DeepSpeed's CPU ops (docs/decisions.md D314)."""
    command, port = on_free_port((cwd / "results" / "cmd_optimal.txt").read_text().strip())
    run = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300)
    remove_shm_buffers(port)  # what DeepSpeed's CPU comm leaves for the launcher's port
    # gloo-backed CPU ranks sometimes abort in the interpreter's teardown after the script ended (test_hf_e2e)
    teardown_abort = run.stderr.strip().endswith("terminate called without an active exception")
    assert run.returncode == 0 or teardown_abort, run.stderr[-3000:]
    return run


def write_config(path: Path, config: dict, **autotuning) -> None:
    config = json.loads(json.dumps(config))
    config.setdefault("autotuning", {}).update(start_profile_step=2, end_profile_step=4, **autotuning)
    path.write_text(json.dumps(config))


def test_a_strict_torchrun_script_is_tuned_warm_and_cold_and_its_torchrun_answer_trains(tmp_path):
    config = json.loads((ROOT / "examples" / "ds_config.json").read_text())
    config["zero_optimization"]["stage"] = [0, 1]
    write_config(tmp_path / "ds.json", config, max_train_micro_batch_size_per_gpu=8)
    torchrun = str(BIN / "torchrun")
    records = tune(tmp_path, ["--device-memory", "3GiB", "--max-launches", "4"],
                   [torchrun, "--nproc_per_node", "2", TORCHRUN_SCRIPT, *TINY_GPT, "--deepspeed_config", "ds.json"])
    assert len(records) == 4
    for name, r in records.items():
        exp_dir = tmp_path / "results" / "exps" / name
        assert r["launch"] == "warm", (name, r["launch_note"])
        # the script refuses --local_rank and asks for torchrun's variables: it ran as torchrun's rank
        assert r["kind"] == "profile" or "(rank 0 of 2, local world 2)" in (exp_dir / "stdout.log").read_text()
        assert " -m torch.distributed.run --nnodes 1 --nproc_per_node 2 " in (exp_dir / "cmd.txt").read_text()
    optimal = tmp_path / "results" / "ds_config_optimal.json"
    command = (tmp_path / "results" / "cmd_optimal.txt").read_text().strip()
    assert command == (f"DS_ACCELERATOR=cpu LOCAL_SIZE=2 {torchrun} --nproc_per_node 2 {TORCHRUN_SCRIPT} "
                       f"{' '.join(TINY_GPT)} --deepspeed_config {optimal}")
    assert "launcher: torchrun" in (tmp_path / "results" / "summary.txt").read_text()
    assert "step 11 loss" in train(tmp_path).stdout

    cold = tmp_path / "cold"
    cold.mkdir()
    (cold / "ds.json").write_text((tmp_path / "ds.json").read_text())
    records = tune(cold, ["--device-memory", "3GiB", "--cold-launch", "--max-launches", "2"],
                   [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", TORCHRUN_SCRIPT, *TINY_GPT,
                    "--deepspeed_config", "ds.json"])
    assert len(records) == 2 and {r["launch"] for r in records.values()} == {"cold"}


def test_the_hf_trainer_is_tuned_under_accelerate_launch_and_torchrun(tmp_path):
    config = json.loads((ROOT / "examples" / "ds_config_hf.json").read_text())
    config["zero_optimization"]["stage"] = 1
    write_config(tmp_path / "ds.json", config, min_train_micro_batch_size_per_gpu=2,
                 max_train_micro_batch_size_per_gpu=4, num_tuning_micro_batch_sizes=1)
    (tmp_path / "zero.yaml").write_text(ACCELERATE_YAML.format(config="ds.json", ranks=2))
    accelerate = str(BIN / "accelerate")
    records = tune(tmp_path, ["--device-memory", "3GiB"], [accelerate, "launch", "--config_file", "zero.yaml",
                                                           HF_SCRIPT, *TINY_HF])
    assert {r["launch"] for r in records.values()} == {"warm"}
    for name, r in records.items():  # the experiment's own config reached the Trainer through Accelerate
        exp_dir = tmp_path / "results" / "exps" / name
        engine = json.loads((exp_dir / "engine_config.json").read_text())
        assert engine["train_micro_batch_size_per_gpu"] == r["ds_config"]["train_micro_batch_size_per_gpu"]
        assert f"ACCELERATE_DEEPSPEED_CONFIG_FILE={exp_dir / 'ds_config.json'}" in (exp_dir / "cmd.txt").read_text()
    results = tmp_path / "results"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    answer_yaml = results / "accelerate_config_optimal.yaml"
    assert f"deepspeed_config_file: {results / 'ds_config_optimal.json'}" in answer_yaml.read_text()
    command = (results / "cmd_optimal.txt").read_text().strip()
    assert command.startswith(f"DS_ACCELERATOR=cpu LOCAL_SIZE=2 {accelerate} launch --config_file {answer_yaml} ")
    run = train(tmp_path)
    assert "trained 8 steps" in run.stdout
    assert f"Instantaneous batch size per device = {optimal['train_micro_batch_size_per_gpu']}" in run.stdout + run.stderr

    under_torchrun = tmp_path / "torchrun"
    under_torchrun.mkdir()
    (under_torchrun / "ds.json").write_text((tmp_path / "ds.json").read_text())
    records = tune(under_torchrun, ["--device-memory", "3GiB", "--max-launches", "2"],
                   [str(BIN / "torchrun"), "--nproc_per_node", "2", HF_SCRIPT, *TINY_HF, "--deepspeed", "ds.json"])
    assert len(records) == 2 and {r["launch"] for r in records.values()} == {"warm"}


def test_a_ulysses_degree_in_accelerates_parallelism_config_reaches_each_experiment_and_the_answer(tmp_path):
    """The Trainer's Llama under ``accelerate launch`` with a YAML whose ``parallelism_config`` sets sp_size 2: each
    experiment's engine runs that group (Accelerate's ``ParallelismConfig`` built from the variables zerotune sets), and
    the answer's YAML keeps it. mbs 1: at mbs 2 this Trainer's sharded labels fail its loss's ``view`` (D339)."""
    config = json.loads((ROOT / "examples" / "ds_config_hf.json").read_text())
    config["zero_optimization"]["stage"] = 1
    write_config(tmp_path / "ds.json", config, max_train_micro_batch_size_per_gpu=1)
    yaml = ACCELERATE_YAML.format(config="ds.json", ranks=2) + "parallelism_config:\n  parallelism_config_sp_size: 2\n"
    (tmp_path / "sp.yaml").write_text(yaml)
    llama = ["--arch", "llama", *TINY_HF]
    records = tune(tmp_path, ["--device-memory", "3GiB", "--max-launches", "2"],
                   [str(BIN / "accelerate"), "launch", "--config_file", "sp.yaml", HF_SCRIPT, *llama])
    assert len(records) == 2
    for name in records:  # a group of 2 ranks is one replica: a step's batch is one sample
        exp_dir = tmp_path / "results" / "exps" / name
        engine = json.loads((exp_dir / "engine_config.json").read_text())
        assert (name[-4:], engine["sequence_parallel_size"], engine["train_batch_size"]) == ("_sp2", 2, 1)
        assert "PARALLELISM_CONFIG_SP_SIZE=2" in (exp_dir / "cmd.txt").read_text()
    results = tmp_path / "results"
    answer = (results / "accelerate_config_optimal.yaml").read_text()
    assert "parallelism_config_sp_size: 2\n" in answer and "parallelism_config_dp_shard_size: 1\n" in answer
    assert json.loads((results / "ds_config_optimal.json").read_text())["sequence_parallel_size"] == 2
    assert "trained 8 steps" in train(tmp_path).stdout


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_trl_sft_script_is_tuned_under_accelerate_launch_and_its_answer_trains(tmp_path, lora):
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "zero_optimization": {"stage": [1, 2]}}
    write_config(tmp_path / "ds.json", config, arg_mappings=TRAINER_MAPPINGS, min_train_micro_batch_size_per_gpu=2,
                 max_train_micro_batch_size_per_gpu=4, num_tuning_micro_batch_sizes=1)
    (tmp_path / "zero.yaml").write_text(ACCELERATE_YAML.format(config="ds.json", ranks=1))
    sft = ["--output_dir", "out", "--max_steps", "8", "--report_to", "none", "--save_strategy", "no", "--max_length",
           "32", "--bf16", "false", "--per_device_train_batch_size", "1", "--lora", str(lora).lower()]
    records = tune(tmp_path, ["--device-memory", "6GiB", *([] if lora else ["--max-launches", "2"])],
                   [str(BIN / "accelerate"), "launch", "--config_file", "zero.yaml", TRL_SCRIPT, *sft])
    assert {r["launch"] for r in records.values()} == {"warm"} and len(records) >= 2
    run = train(tmp_path)
    # a LoRA adapter of rank 8 on q_proj and v_proj of 2 layers of width 64: 2 x 2 x 8 x (64 + 64) trainable
    trainable = 4096 if lora else 134_208
    assert "trained 8 steps" in run.stdout and f"{trainable} trainable parameters" in run.stdout, run.stdout[-2000:]
