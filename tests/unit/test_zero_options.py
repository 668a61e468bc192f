"""The memory terms of DeepSpeed's options beyond stage, offload and buckets (zerotune.model.zero_options): 16-bit
master weights and optimizer states, hpZ, ZeRO-3's optimizer sub-groups (partial offload), AutoTP, Ulysses; and the
settings DeepSpeed has removed (MiCS), refused in DeepSpeed's own words before anything runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune import cli
from zerotune.model.memory import MemoryModel
from zerotune.model.zero_options import ZeroOptions

Z = "zero_optimization"
BF16 = {"enabled": True}
LOW = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
CONFIGS = [{"bf16": BF16, Z: {"stage": 2}}, {"bf16": LOW, Z: {"stage": 2}},
           {"bf16": BF16, Z: {"stage": 3}}, {"bf16": LOW, Z: {"stage": 3}},
           {"bf16": BF16, Z: {"stage": 3, "zero_hpz_partition_size": 2}},
           {"bf16": BF16, Z: {"stage": 3, "sub_group_size": 40_000}}]
# tests/helpers/zero_states.py's model: 4 bias-free 256 x 256 layers, 2 ranks
MODEL = MemoryModel(num_params=262_144, activation_bytes_per_sample=0, dp_world_size=2, largest_layer_params=65_536)


@pytest.mark.e2e
def test_each_term_equals_what_a_real_two_rank_engine_holds(tmp_path):
    configs = [{"train_micro_batch_size_per_gpu": 2, **c} for c in CONFIGS]
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    helper = Path(__file__).parents[1] / "helpers" / "zero_states.py"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(helper), str(tmp_path / "configs.json"), str(tmp_path / "held.jsonl")],
                   env=env, check=True, capture_output=True, timeout=300)
    held = [json.loads(line) for line in (tmp_path / "held.jsonl").read_text().splitlines()]
    for config, real in zip(configs, held):
        # the optimizer's term is the states and the master partition: 8 + 4 bytes a parameter over 2 ranks in fp32,
        # 4 + 2 with bf16 master weights and optimizer states
        assert MODEL.breakdown(config).optimizer_states == real["states"] + real["master"], config
    assert [h["master_dtype"] for h in held[:2]] == ["torch.float32", "torch.bfloat16"]
    assert (held[1]["states"], held[1]["master"]) == (4 * 131_072, 2 * 131_072)
    # hpZ: a secondary partition of the 16-bit parameters over the 2 ranks of its group
    assert MODEL.breakdown(configs[4]).parameters - MODEL.breakdown(configs[2]).parameters == held[4]["secondary"] \
        == 2 * 262_144 // 2
    # sub-groups: 131,072 elements a rank in 4 tensors of 32,768, closed at 40,000: 2 (DeepSpeed's default: 1)
    options = [ZeroOptions.of(c) for c in configs]
    assert [o.sub_groups(131_072, 65_536 / 2) for o in options[2:]] == [h["sub_groups"] for h in held[2:]] \
        == [1, 1, 1, 2]


def test_partial_offload_keeps_the_first_sub_groups_on_the_device_as_deepspeed_splits_them():
    # stage3.py:1105: sub-group i goes to the host from int((1 - r) * G) on
    many = ZeroOptions(offload_ratio=0.3, sub_group_size=100)
    assert (many.sub_groups(1000), many.device_fraction(1000)) == (10, 0.7)
    assert ZeroOptions(offload_ratio=0.3).device_fraction(5e8) == 0  # one sub-group: all of it offloaded
    config = {"bf16": BF16, Z: {"stage": 3, "sub_group_size": 100_000,
                                "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    full = {"bf16": BF16, Z: {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    model = MemoryModel(num_params=800_000, activation_bytes_per_sample=0, dp_world_size=2)
    half, none = model.breakdown(config), model.breakdown(full)
    # 400,000 elements a rank in 4 sub-groups: 2 stay, with their states, master and fp32 gradients (8 + 4 + 4)
    assert (half.optimizer_states, none.optimizer_states) == ((8 + 4) * 200_000, 0)
    assert half.gradients - none.gradients == 4 * 200_000
    assert none.host - half.host == (8 + 4 + 4) * 200_000


def test_autotp_shards_the_parameters_and_the_data_parallel_group():
    plain = {"bf16": BF16, Z: {"stage": 1}}
    tp = {**plain, "tensor_parallel": {"autotp_size": 2}}
    model = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=0, dp_world_size=8)
    a, b = model.breakdown(plain), model.breakdown(tp)
    assert (a.parameters, b.parameters) == (2 * 1_000_000, 2 * 500_000)
    # stage 1: the states over DP = 8 / 2 = 4 ranks, each holding half the model
    assert (a.optimizer_states, b.optimizer_states) == (12 * 1_000_000 // 8, 12 * 500_000 // 4)


def test_ulysses_divides_a_samples_activations_over_the_sequence_parallel_ranks():
    model = MemoryModel(num_params=1000, activation_bytes_per_sample=8_000, dp_world_size=4)
    assert model.activation_bytes({"sequence_parallel_size": 4}) == 2_000
    measured_at_sp2 = MemoryModel(num_params=1000, activation_bytes_per_sample=4_000, dp_world_size=4, activation_sp=2)
    assert measured_at_sp2.activation_bytes({"sequence_parallel_size": 4}) == 2_000
    assert measured_at_sp2.activation_bytes({}) == 8_000


def test_a_setting_deepspeed_has_removed_is_exit_2_in_deepspeeds_words(tmp_path, capsys):
    cfg, script = tmp_path / "ds.json", tmp_path / "train.py"
    script.write_text("print('never run')\n")
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": LOW,
                               "compile": {"passes": ["z3"]},
                               "torch_autocast": {"lower_precision_safe_modules": ["torch.nn.Linear"]},
                               Z: {"stage": 3, "mics_shard_size": 2}, "autotuning": {"model_info": {"num_params": 1000}}}))
    code = cli.main(["tune", "--dry-run", "--num_gpus", "2", "--device-memory", "2GiB", "--results-dir",
                     str(tmp_path / "r"), str(script), "--deepspeed_config", str(cfg)])
    assert code == 2
    assert capsys.readouterr().err.startswith(
        f"zerotune: error: {cfg}: DeepSpeed refuses the config: MiCS ZeRO-3 sharding has been removed; "
        "'zero_optimization.mics_shard_size' is no longer supported.")
    assert not (tmp_path / "r").exists()


def test_a_steps_distinct_samples_count_an_autotp_group_once_and_a_ulysses_group_as_deepspeed_does():
    from zerotune.model.zero_options import samples_per_step
    # 8 ranks at mbs 4, gas 2: DeepSpeed's train_batch_size 64 counts every AutoTP rank, so AutoTP 2 trains 32
    assert samples_per_step({"train_batch_size": 64, "tensor_parallel": {"autotp_size": 2}}) == 32
    assert samples_per_step({"train_batch_size": 64}) == 64
    # no train_batch_size (a Trainer's, derived): mbs x gas x ranks, one replica per Ulysses group of 4
    derived = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "sequence_parallel_size": 4}
    assert samples_per_step(derived, devices=8) == 16
    assert samples_per_step(derived) is None and samples_per_step({"train_batch_size": "auto"}, 8) is None
