"""A Hugging Face Trainer config: each "auto" value resolved as the Trainer resolves it, concrete launched configs."""
import json
from types import SimpleNamespace

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import ExperimentKind
from zerotune.core.launch import Node
from zerotune.deepspeed.auto import ENGINE_RECORD, auto_paths, hidden_size_autos, resolve, script_autos
from zerotune.inputs.configs import PROFILE_BUCKET_SIZE, ConfigBuilder
from zerotune.inputs.job import Job, TuneOptions
from zerotune.probe._zerotune_probe.engine import _hidden_size, _max_positions
from zerotune.report.results import optimal_config

GiB = 2**30
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}
HF = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
      "zero_optimization": {"stage": [1, 3], "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                            "stage3_param_persistence_threshold": "auto"},
      "autotuning": {"arg_mappings": MAPPINGS, "max_train_micro_batch_size_per_gpu": 8}}


def job_for(tmp_path, config=None, args=(), **autotuning):
    cfg = json.loads(json.dumps(config or HF))
    cfg.setdefault("autotuning", {}).update(autotuning)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    opts = TuneOptions(device_memory_bytes=3 * GiB, cpu=True, results_dir=str(tmp_path / "results"))
    return Job.build("train.py", ["--deepspeed", str(path), *args], [Node("localhost", (0, 1))], opts)


def test_auto_paths_cover_nested_keys_and_lists_but_not_autotuning():
    assert auto_paths({**HF, "x": [1, "auto"], "autotuning": {"y": "auto"}}) == [
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
        "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "x"]


@pytest.mark.parametrize("args,gas", [
    ((), 1),  # the Trainer's default
    (("--gradient_accumulation_steps", "4"), 4),
    (("--gradient_accumulation_steps=4", "--gradient_accumulation_steps", "3"), 3),  # the last one, as argparse
])
def test_auto_gas_is_the_scripts_value(args, gas):
    assert script_autos(HF, args, MAPPINGS)["gradient_accumulation_steps"] == gas


def test_auto_gas_unmapped_reads_the_trainers_own_flag_and_a_bad_value_names_it():
    assert script_autos(HF, ["--gradient_accumulation_steps", "2", "--ga", "5"], {}) == {
        "gradient_accumulation_steps": 2, "fp16.enabled": False, "bf16.enabled": False}
    assert script_autos(HF, ["--ga", "5"], {"gradient_accumulation_steps": "--ga"})["gradient_accumulation_steps"] == 5
    with pytest.raises(ConfigError, match=r"^ds\.json: 'gradient_accumulation_steps' is \"auto\", filled from the "
                                          r"script's --gradient_accumulation_steps '0': expected a positive integer"):
        script_autos(HF, ["--gradient_accumulation_steps", "0"], MAPPINGS, "ds.json")


@pytest.mark.parametrize("args,fp16,bf16", [
    ((), False, False),
    (("--bf16",), False, True),
    (("--bf16", "--output_dir", "o"), False, True),
    (("--bf16", "False"), False, False),
    (("--fp16=true",), True, False),
    (("--fp16_full_eval", "yes"), True, False),
    (("--bf16_full_eval", "1", "--fp16", "no"), False, True),
])
def test_auto_precision_is_the_scripts_flags(args, fp16, bf16):
    values = script_autos(HF, args, MAPPINGS)
    assert (values["fp16.enabled"], values["bf16.enabled"]) == (fp16, bf16)


def test_a_precision_flag_the_trainer_would_refuse_is_an_error():
    with pytest.raises(ConfigError, match=r"the script's --bf16 'maybe': expected true or false"):
        script_autos(HF, ["--bf16", "maybe"], MAPPINGS)


def test_hidden_size_autos_are_the_trainers_values():
    assert hidden_size_autos(128) == {"zero_optimization.reduce_bucket_size": 16384,
                                      "zero_optimization.stage3_prefetch_bucket_size": 14745,
                                      "zero_optimization.stage3_param_persistence_threshold": 1280}


def test_resolve_replaces_auto_only_and_dedupes_candidate_lists():
    cfg = {"a": "auto", "b": {"c": ["auto", 5, 7]}, "d": 1}
    assert resolve(cfg, {"a": 2, "b.c": 5, "d": 9, "missing.x": 1}) == {"a": 2, "b": {"c": [5, 7]}, "d": 1}
    assert cfg["a"] == "auto"


def test_profile_is_concrete_with_small_buckets_and_the_trainer_fills_the_rest(tmp_path):
    job = job_for(tmp_path, args=("--bf16",))
    exp = ConfigBuilder(job).profile()
    cfg = exp.ds_config
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": PROFILE_BUCKET_SIZE,
                                        "stage3_prefetch_bucket_size": PROFILE_BUCKET_SIZE,
                                        "stage3_param_persistence_threshold": 100_000,  # DeepSpeed's default
                                        "stage3_max_live_parameters": PROFILE_BUCKET_SIZE}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (1, 1)
    assert "train_batch_size" not in cfg  # DeepSpeed derives it; the Trainer's own sum is 1 x mbs x gas on CPU
    assert (cfg["fp16"], cfg["bf16"]) == ({"enabled": False}, {"enabled": True})
    assert cfg["optimizer"]["params"] == {"lr": "auto", "betas": "auto"} and cfg["gradient_clipping"] == "auto"


def test_experiments_take_the_bucket_autos_from_the_profiles_record_of_the_model(tmp_path):
    job = job_for(tmp_path, args=("--gradient_accumulation_steps", "2"))
    builder = ConfigBuilder(job)
    with pytest.raises(ConfigError, match=r"ds\.json: zero_optimization.reduce_bucket_size, .* = \"auto\": the "
                                          r"Trainer fills it from the model's hidden size, and no profile run has "
                                          r"recorded it \(.*engine_config.json is missing\)"):
        builder.config(1, 4)
    record = job.exps_dir / builder.profile().name / ENGINE_RECORD
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"hidden_size": None}))
    with pytest.raises(ConfigError, match=r"the model has no hidden size"):
        builder.config(1, 4)
    record.write_text(json.dumps({"hidden_size": 128}))
    z1, z3 = builder.config(1, 4), ConfigBuilder(job).config(3, 8)
    assert z1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 16384}
    assert z3["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 16384, "stage3_prefetch_bucket_size": 14745,
                                       "stage3_param_persistence_threshold": 1280}
    assert (z1["train_micro_batch_size_per_gpu"], z1["gradient_accumulation_steps"]) == (4, 2)
    assert "train_batch_size" not in z1
    # the knob phase keeps the user's "auto" buckets at the Trainer's value, and tunes the others
    knobs = builder.knob_space(3, 4)
    assert {c.ds_config["zero_optimization"]["reduce_bucket_size"] for c in knobs} == {16384}
    assert len({c.ds_config["zero_optimization"].get("stage3_max_live_parameters") for c in knobs}) > 1
    # the optimal config keeps what the Trainer fills, with the values cmd_optimal.txt passes
    best = optimal_config(builder.experiment(z1, ExperimentKind.MBS))
    assert best["optimizer"]["params"] == {"lr": "auto", "betas": "auto"}
    assert best["train_micro_batch_size_per_gpu"] == 4 and "autotuning" not in best


def test_a_numeric_train_batch_size_is_kept(tmp_path):
    job = job_for(tmp_path, {**HF, "train_batch_size": 16})
    cfg = ConfigBuilder(job).profile().ds_config
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        16, 1, 8)


def test_a_trainer_config_without_its_batch_mapped_is_refused(tmp_path):
    config = {**HF, "autotuning": {}}
    with pytest.raises(ConfigError, match=r"ds\.json: a Hugging Face Trainer config \(it holds \"auto\" values\) "
                                          r"needs 'autotuning.arg_mappings' for 'train_micro_batch_size_per_gpu', "
                                          r"e.g. \{\"train_micro_batch_size_per_gpu\": "
                                          r"\"--per_device_train_batch_size\"\}"):
        job_for(tmp_path, config)
    only_mbs = {**HF, "autotuning": {"arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"}}}
    job_for(tmp_path, only_mbs)  # gas stays the script's: nothing to map
    with pytest.raises(ConfigError, match=r"needs 'autotuning.arg_mappings' for 'gradient_accumulation_steps'"):
        job_for(tmp_path, only_mbs, max_train_batch_size=64)  # gas doubling


def test_the_probe_reads_the_hidden_size_where_the_trainer_does():
    cfg = SimpleNamespace
    assert _hidden_size(cfg(config=cfg(hidden_size=768))) == 768
    assert _hidden_size(cfg(config=cfg(hidden_sizes=[64, 256, 128]))) == 256
    assert _hidden_size(cfg(config=cfg(text_config=cfg(hidden_size=32)))) == 32
    assert _hidden_size(cfg(config=None)) is None and _hidden_size(None) is None


def test_the_probe_reads_the_longest_sequence_the_model_takes():
    cfg = SimpleNamespace
    assert _max_positions(cfg(config=cfg(n_positions=1024))) == 1024  # GPT-2
    assert _max_positions(cfg(config=cfg(max_position_embeddings=4096))) == 4096  # Llama, OPT, BERT
    assert _max_positions(cfg(config=cfg(text_config=cfg(max_position_embeddings=512)))) == 512
    assert _max_positions(cfg(config=cfg(n_positions=True))) is None and _max_positions(None) is None


def test_the_optimal_command_and_zerotune_run_pass_the_optimal_configs_values(tmp_path):
    from zerotune.autotuner import Autotuner
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF))
    opts = TuneOptions(device_memory_bytes=3 * GiB, cpu=True, results_dir=str(tmp_path / "results"))
    script = tmp_path / "train.py"
    script.write_text("")
    tuner = Autotuner(str(script), ["--per_device_train_batch_size", "1", "--deepspeed", str(path), "--bf16"],
                      [Node("localhost", (0, 1))], opts)
    optimal = tmp_path / "ds_config_optimal.json"
    optimal.write_text(json.dumps({**HF, "train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 3}))
    command = tuner.optimal_command(str(optimal))
    assert command.endswith(f"train.py --per_device_train_batch_size 12 --deepspeed {optimal} --bf16 "
                            f"--gradient_accumulation_steps 3")
    # the results are written after every text is made: the command of a config not written yet maps its values
    unwritten = tmp_path / "not_yet.json"
    assert tuner.optimal_command(str(unwritten), json.loads(optimal.read_text())) == command.replace(
        str(optimal), str(unwritten))
