"""Config parsing: DeepSpeed's autotuning keys, stage candidates, config path in script args."""
import json

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Status
from zerotune.core.units import parse_bytes
from zerotune.deepspeed.config import (
    find_config_arg,
    load_ds_config,
    parse_autotuning,
    replace_config_arg,
    stage_candidates,
)
from zerotune.run.expdir import classify


def test_autotuning_defaults_follow_deepspeed_except_overwrite():
    at = parse_autotuning({"fast": False, "metric": "latency", "tuner_type": "model_based"})
    assert (at.fast, at.metric, at.start_profile_step, at.end_profile_step) == (False, "latency", 3, 5)
    assert (at.num_tuning_micro_batch_sizes, at.tuner_num_trials, at.tuner_early_stopping) == (3, 50, 5)
    assert at.overwrite is False  # resume by default


def test_unknown_key_and_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"ds.json: unknown key 'autotuning.fastt'"):
        parse_autotuning({"fastt": True}, source="ds.json")
    with pytest.raises(ConfigError, match=r"'autotuning.metric' = 'speed'"):
        parse_autotuning({"metric": "speed"})
    with pytest.raises(ConfigError, match=r"end_profile_step \(2\) must be >= start_profile_step \(3\)"):
        parse_autotuning({"end_profile_step": 2})
    for bad in ("max steps", "steps", "--steps=3", "--deepspeed_config"):
        with pytest.raises(ConfigError, match=r"'autotuning.max_steps_arg' = .*expected the script's flag for its "
                                              r"length in steps, such as '--max_steps'"):
            parse_autotuning({"max_steps_arg": bad}, source="ds.json")
    assert parse_autotuning({"max_steps_arg": "--train-iters"}).max_steps_arg == "--train-iters"


@pytest.mark.parametrize("value,expected", [(1, [1]), ([3, 1, 1], [1, 3]), ("all", [0, 1, 2, 3]), (None, [0, 1, 2, 3])])
def test_stage_candidates(value, expected):
    zero = {} if value is None else {"stage": value}
    assert stage_candidates({"zero_optimization": zero}) == expected


@pytest.mark.parametrize("value", [4, "two", [1, 5], True])
def test_bad_stage(value):
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        stage_candidates({"zero_optimization": {"stage": value}})


def test_config_arg_forms():
    assert find_config_arg(["--steps", "3", "--deepspeed_config", "a.json"]) == (3, "a.json")
    assert find_config_arg(["--deepspeed", "b.json"]) == (1, "b.json")
    assert find_config_arg(["--deepspeed", "--deepspeed_config=c.json"]) == (1, "c.json")
    assert replace_config_arg(["--deepspeed_config=c.json", "-x"], "/r/d.json") == ["--deepspeed_config=/r/d.json", "-x"]
    with pytest.raises(ConfigError, match="carry no DeepSpeed config"):
        find_config_arg(["--deepspeed"])
    with pytest.raises(ConfigError) as twice:
        find_config_arg(["--deepspeed_config", "a.json", "--steps", "3", "--deepspeed=b.json"])
    assert str(twice.value) == ("the training script's arguments carry a DeepSpeed config twice (--deepspeed_config "
                                "'a.json' and --deepspeed 'b.json'): give it once, so that the config zerotune tunes "
                                "is the one the script reads")
    for args in (["--deepspeed_config", ""], ["--deepspeed_config="]):  # an unset shell variable
        with pytest.raises(ConfigError, match="^--deepspeed_config '': expected the path of a DeepSpeed config, not "
                                              "the empty string$"):
            find_config_arg(args)


def test_load_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n "a": 1,\n}')
    with pytest.raises(ConfigError, match=r"ds.json:3:1: invalid JSON"):
        load_ds_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_ds_config(tmp_path / "missing.json")


def test_parse_bytes():
    assert parse_bytes("3GiB") == 3 * 2**30
    assert parse_bytes("2.5GB") == 2_500_000_000
    assert parse_bytes("3000000000") == 3_000_000_000
    with pytest.raises(ConfigError, match="--device-memory = '3 parsecs'"):
        parse_bytes("3 parsecs")


def test_classify_never_uses_the_word_error_and_never_scores_zero():
    ok = classify(0, {"throughput": 12.5}, "throughput", "UserWarning: an error-free error message", False)
    assert ok == (Status.OK, "")
    oom = classify(1, None, "throughput", "RuntimeError: [enforce fail at alloc_cpu.cpp:121] "
                   "DefaultCPUAllocator: can't allocate memory: you tried to allocate 2000000000 bytes.", False)
    assert oom[0] == Status.OOM and "DefaultCPUAllocator" in oom[1]
    assert classify(None, None, "throughput", "", True)[0] == Status.TIMEOUT
    failed = classify(1, None, "throughput", "Traceback\nValueError: bad shape\n", False)
    assert failed == (Status.FAILED, "exit code 1: ValueError: bad shape")
    assert classify(0, {"throughput": 0}, "throughput", "", False)[0] == Status.FAILED


def test_a_section_deepspeed_reads_as_an_object_is_one_or_a_list_of_candidate_ones(tmp_path, capsys):
    """``"optimizer": 1`` ended in an AttributeError in the memory model (issue 39): exit 2 naming it."""
    from zerotune import cli
    cfg, script = tmp_path / "ds.json", tmp_path / "train.py"
    script.write_text("print('never run')\n")
    tune = ["tune", "--dry-run", "--num_gpus", "1", "--device-memory", "2GiB", "--results-dir", str(tmp_path / "r"),
            str(script), "--deepspeed_config", str(cfg)]
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
            "autotuning": {"model_info": {"num_params": 1000}}}
    for key, value, example in (("optimizer", 1, '{"type": "AdamW"}'), ("fp16", "yes", '{"enabled": true}'),
                                ("scheduler", [{"type": "WarmupLR"}, 2], '{"type": "AdamW"}')):
        cfg.write_text(json.dumps({**base, key: value}))
        assert cli.main(tune) == 2
        assert capsys.readouterr().err == (f"zerotune: error: {cfg}: '{key}' = {value!r}: expected an object such as "
                                           f"{example}, or a list of candidate objects\n")
    cfg.write_text(json.dumps({**base, "optimizer": [{"type": "Adam"}, {"type": "AdamW"}]}))  # candidates
    assert cli.main(tune) == 0
    capsys.readouterr()
    assert cli.main(["estimate", "--num-params", "1e6", "--device-memory", "1GiB", "--deepspeed", str(cfg)]) == 2
    assert capsys.readouterr().err == (f"zerotune: error: --deepspeed {cfg}: 'optimizer' = [{{'type': 'Adam'}}, "
                                       "{'type': 'AdamW'}]: expected an object such as {\"type\": \"AdamW\"}\n")
    assert not (tmp_path / "r").exists()
