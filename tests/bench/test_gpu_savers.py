"""benchmarks/gpu_savers.py: the re-measure runs each tuner's answer with the tuner's own flags, and the report reads
its savers from the config and the command (the GPU run itself is benchmarks/gpu_savers.sh)."""
import json

from benchmarks.gpu_savers import checkpointing, measure_args, offload, script_args

ZT_CMD = ("PYTHON_ZEROTUNE_X=1 deepspeed --num_gpus 1 --master_port 29500 benchmarks/gpu_savers_train.py --n_layer 24 "
          "--bf16 true --per_device_train_batch_size=8 --gradient_accumulation_steps 2 --gradient_checkpointing True "
          "--deepspeed /tmp/r/ds_config_optimal.json")
DS_CMD = ("deepspeed --num_gpus 1 --master_port 29701 /repo/benchmarks/gpu_savers_train.py --local_rank=0 --n_layer 24 "
          "--per_device_train_batch_size 4 --gradient_accumulation_steps 1 --deepspeed eyJ0cmFpbl9iYXRjaCI6IDR9")


def test_the_answer_runs_with_the_tuners_flags_and_this_runs_config_steps_and_output():
    assert measure_args(script_args(ZT_CMD), "/w/cfg.json", 7, "/w/hf") == [
        "--n_layer", "24", "--bf16", "true", "--per_device_train_batch_size=8", "--gradient_accumulation_steps", "2",
        "--gradient_checkpointing", "True", "--deepspeed", "/w/cfg.json", "--max_steps", "7", "--output_dir", "/w/hf"]
    assert measure_args(script_args(DS_CMD), "/w/cfg.json", 7, "/w/hf") == [
        "--n_layer", "24", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--deepspeed", "/w/cfg.json", "--max_steps", "7", "--output_dir", "/w/hf"]


def test_checkpointing_is_what_the_command_passes_as_the_trainer_parses_it():
    assert checkpointing(script_args(ZT_CMD)) is True
    assert checkpointing(script_args(DS_CMD)) is False
    assert checkpointing(["--gradient_checkpointing", "--bf16", "true"]) is True  # a bare flag is on
    assert checkpointing(["--gradient_checkpointing=false"]) is False
    assert checkpointing(None) is None


def test_offload_names_each_offloaded_section():
    cfg = json.loads('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, '
                     '"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}')
    assert offload(cfg) == "opt+param:nvme"
    assert offload({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}) == "none"
    assert offload({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}) == "opt"
