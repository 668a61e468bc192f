"""autotuning.arg_mappings: each experiment's config values as the script's own arguments."""
import base64
import dataclasses
import json
import sys

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.deepspeed.args import (
    apply_arg_mappings,
    arg_text,
    check_mapped_keys,
    flag_value,
    mapped_value,
    parse_arg_mappings,
    raise_steps,
    step_flag,
)
from zerotune.deepspeed.launcher import launch_command

MBS_FLAG = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}
CFG = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}


def test_space_form_is_replaced_in_place():
    args = ["--output_dir", "o", "--per_device_train_batch_size", "1", "--max_steps", "5"]
    assert apply_arg_mappings(args, MBS_FLAG, CFG) == [
        "--output_dir", "o", "--per_device_train_batch_size", "8", "--max_steps", "5"]
    assert args[3] == "1"  # not modified


def test_equals_form_is_replaced_in_place():
    args = ["--per_device_train_batch_size=1", "--max_steps=5"]
    assert apply_arg_mappings(args, MBS_FLAG, CFG) == ["--per_device_train_batch_size=8", "--max_steps=5"]


def test_absent_flag_is_appended():
    assert apply_arg_mappings(["--max_steps", "5"], MBS_FLAG, CFG) == [
        "--max_steps", "5", "--per_device_train_batch_size", "8"]


def test_every_occurrence_of_a_repeated_flag_gets_the_value():
    # argparse reads the last occurrence; DeepSpeed's own autotuner replaced only the first
    args = ["--per_device_train_batch_size", "1", "--x", "--per_device_train_batch_size=2",
            "--per_device_train_batch_size", "3"]
    assert apply_arg_mappings(args, MBS_FLAG, CFG) == [
        "--per_device_train_batch_size", "8", "--x", "--per_device_train_batch_size=8",
        "--per_device_train_batch_size", "8"]
    assert flag_value(apply_arg_mappings(args, MBS_FLAG, CFG), "--per_device_train_batch_size") == "8"


def test_a_prefix_of_another_flag_is_not_touched():
    args = ["--per_device_train_batch_size_x", "1", "--per_device_train_batch_size_y=1"]
    assert apply_arg_mappings(args, MBS_FLAG, CFG) == args + ["--per_device_train_batch_size", "8"]


def test_a_flag_without_a_value_gets_one_and_a_negative_value_is_a_value():
    mappings = {"gradient_checkpointing": "--gradient_checkpointing", "seed": "--seed"}
    cfg = {"gradient_checkpointing": False, "seed": 7}
    assert apply_arg_mappings(["--gradient_checkpointing", "--seed", "-1"], mappings, cfg) == [
        "--gradient_checkpointing", "False", "--seed", "7"]
    assert apply_arg_mappings(["--x", "--gradient_checkpointing"], mappings, cfg) == [
        "--x", "--gradient_checkpointing", "False", "--seed", "7"]


def test_gas_and_mbs_together_and_auto_or_absent_values_leave_the_arguments():
    mappings = {**MBS_FLAG, "gradient_accumulation_steps": "--gradient_accumulation_steps",
                "optimizer.params.lr": "--learning_rate", "absent": "--absent"}
    cfg = {**CFG, "optimizer": {"params": {"lr": "auto"}}}
    assert apply_arg_mappings(["--gradient_accumulation_steps", "1", "--learning_rate", "3e-4"], mappings, cfg) == [
        "--gradient_accumulation_steps", "2", "--learning_rate", "3e-4", "--per_device_train_batch_size", "8"]


def test_lookup_by_dotted_path_top_level_then_first_section():
    cfg = {"optimizer": {"params": {"lr": 0.1}}, "zero_optimization": {"stage": 2, "overlap_comm": True},
           "autotuning": {"fast": False}, "fast": None}
    assert mapped_value(cfg, "optimizer.params.lr") == 0.1
    assert mapped_value(cfg, "overlap_comm") is True
    assert mapped_value(cfg, "lr") == 0.1
    assert mapped_value(cfg, "zero_optimization.reduce_bucket_size") is None
    assert mapped_value({"autotuning": {"fast": False}}, "fast") is None  # never the autotuning section


def test_values_as_script_arguments():
    assert [arg_text(v) for v in (8, 5e8, 3e-05, True, [0.9, 0.95], "x")] == [
        "8", "500000000", "3e-05", "True", "[0.9,0.95]", "x"]


def test_flag_value_reads_what_the_parser_reads():
    assert flag_value(["--fp16", "--bf16", "true", "--gas=4", "--gas", "2"], "--gas") == "2"
    assert flag_value(["--fp16", "--bf16", "true"], "--fp16") == ""
    assert flag_value(["--fp16", "--bf16", "true"], "--bf16") == "true"
    assert flag_value(["--fp16"], "--fp1") is None


@pytest.mark.parametrize("mappings,message", [
    ({"": "--x"}, r"'autotuning.arg_mappings.' = '--x': expected a ds_config key"),
    ({"autotuning.fast": "--x"}, r"'autotuning.arg_mappings.autotuning.fast' = '--x': expected a ds_config key"),
    ({"train_micro_batch_size_per_gpu": "bs"}, r"= 'bs': expected the script's flag"),
    ({"train_micro_batch_size_per_gpu": "--bs=1"}, r"= '--bs=1': expected the script's flag"),
    ({"train_micro_batch_size_per_gpu": "--"}, r"= '--': expected the script's flag"),
    ({"train_micro_batch_size_per_gpu": "--deepspeed"}, r"--deepspeed carries the ds_config path"),
    ({"train_micro_batch_size_per_gpu": "--bs", "gradient_accumulation_steps": "--bs"},
     r"'autotuning.arg_mappings.gradient_accumulation_steps' = '--bs': --bs is mapped from "
     r"'train_micro_batch_size_per_gpu' too"),
])
def test_bad_mappings_name_the_entry(mappings, message):
    with pytest.raises(ConfigError, match=r"^ds\.json: .*" + message):
        parse_arg_mappings(mappings, "ds.json")


def test_a_mapped_key_no_experiment_holds_is_an_error():
    check_mapped_keys({"train_micro_batch_size_per_gpu": "--bs", "stage": "--stage", "gc": "--gc"}, {"gc": [1, 2]})
    with pytest.raises(ConfigError, match=r"ds\.json: 'autotuning.arg_mappings.optimizer.params.lr' = '--lr': the "
                                          r"config does not set 'optimizer.params.lr'"):
        check_mapped_keys({"optimizer.params.lr": "--lr"}, {"optimizer": {"type": "Adam"}}, "ds.json")


def test_launch_command_passes_the_launched_configs_values(tmp_path):
    config = tmp_path / "exp" / "ds_config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}))
    spec = LaunchSpec(script="train.py", script_args=("--deepspeed", "user.json", "--per_device_train_batch_size=1"),
                      arg_mappings=(("train_micro_batch_size_per_gpu", "--per_device_train_batch_size"),
                                    ("gradient_accumulation_steps", "--gradient_accumulation_steps")))
    cmd = launch_command(spec, Reservation((Node("localhost", (0, 1)),)), str(config), 29501)
    assert cmd[cmd.index("train.py"):] == ["train.py", "--deepspeed", str(config), "--per_device_train_batch_size=4",
                                           "--gradient_accumulation_steps", "3"]
    plain = LaunchSpec(script="train.py", script_args=("--deepspeed", "user.json", "--bs", "1"))
    assert launch_command(plain, Reservation((Node("localhost", (0,)),)), "/x.json", 1)[-4:] == [
        "--deepspeed", "/x.json", "--bs", "1"]


def test_an_experiments_steps_flag_is_raised_past_the_last_measured_step_and_the_answers_is_not(tmp_path):
    # end_profile_step 15 (an adaptive run's extended exit) at gas 3: 17 optimizer steps are 51 micro steps
    exp = {"gradient_accumulation_steps": 3, "autotuning": {"end_profile_step": 15}}
    assert raise_steps(["--steps", "6", "--lr=1"], "--steps", exp) == ["--steps", "51", "--lr=1"]
    assert raise_steps(["--max_steps=4"], "--max_steps", exp) == ["--max_steps=51"]
    assert raise_steps(["--lr", "1"], "--steps", exp) == ["--lr", "1", "--steps", "51"]  # absent: appended
    assert raise_steps(["--steps", "1000"], "--steps", exp) == ["--steps", "1000"]  # already long enough
    answer = {"gradient_accumulation_steps": 3}  # ds_config_optimal.json: no autotuning section
    assert raise_steps(["--steps", "6"], "--steps", answer) == ["--steps", "6"]
    # through the launch: the experiment's config file carries its end_profile_step
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "autotuning": {"end_profile_step": 5}}))
    spec = LaunchSpec(script="train.py", script_args=("--deepspeed", "user.json", "--steps", "2"),
                      max_steps_arg="--steps")
    cmd = launch_command(spec, Reservation((Node("localhost", (0,)),)), str(config), 29501)
    assert cmd[cmd.index("train.py"):] == ["train.py", "--deepspeed", str(config), "--steps", "7"]


def test_the_steps_flag_named_is_max_steps_arg_else_the_first_known_one_in_the_command():
    assert step_flag(["--max_steps", "40", "--steps", "3"]) == "--max_steps"
    assert step_flag(["--train-iters=9"]) == "--train-iters"
    assert step_flag(["--epochs", "1"]) is None
    assert step_flag(["--epochs", "1"], "--iters") == "--iters"


def test_an_experiment_on_this_machine_starts_deepspeeds_node_launcher_with_the_runners_arguments():
    spec = LaunchSpec(script="train.py", script_args=("--deepspeed_config", "user.json"))
    here = Reservation((Node("localhost", (2, 3)),))
    cmd = launch_command(spec, here, "/x.json", 29501, direct=True)
    # what deepspeed/launcher/runner.py execs for a single-node run: the world as base64 JSON {host: slots}
    assert cmd[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    assert cmd[4:11] == ["--world_info", "eyJsb2NhbGhvc3QiOiBbMiwgM119", "--master_addr", "127.0.0.1",
                         "--master_port", "29501", "train.py"]
    assert json.loads(base64.urlsafe_b64decode(cmd[5])) == {"localhost": [2, 3]}
    # the line to paste, and any run on other hosts, go through the deepspeed runner
    assert launch_command(spec, here, "/x.json", 29501)[1:5] == ["--include", "localhost:2,3", "--master_port", "29501"]
    remote = dataclasses.replace(spec, hostfile="/hosts")
    multi = launch_command(remote, Reservation((Node("worker-1", (0,)), Node("worker-2", (0,)))), "/x.json", 1,
                           direct=True)
    assert multi[1:4] == ["--hostfile", "/hosts", "--force_multi"]
