"""The tuning job: every input resolved once, every bad one an error naming it."""
import json
import os
import subprocess
import sys

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.launch import Node
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job, TuneOptions

GiB = 2**30


def build(tmp_path, config=None, nodes=(Node("localhost", (0, 1)),), **options):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **(config or {})}))
    opts = TuneOptions(device_memory_bytes=3 * GiB, cpu=True, results_dir=str(tmp_path / "results"))
    for k, v in options.items():
        setattr(opts, k, v)
    return Job.build("train.py", ["--deepspeed_config", str(path)], list(nodes), opts)


def test_resolves_sizes_bounds_and_paths(tmp_path):
    job = build(tmp_path, {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": [3, 1]},
                           "autotuning": {"metric": "latency", "max_train_batch_size": 40}})
    assert (job.world_size, job.dp_world_size, job.batch.gas, job.stages) == (2, 2, 2, (1, 3))
    assert (job.min_mbs, job.max_mbs) == (1, 10)  # 40 // (gas 2 * DP 2)
    assert (job.objective.name, job.objective.unit, job.objective.scale) == ("latency", "s/step", 1e-6)
    assert job.exps_dir == tmp_path / "results" / "exps"
    assert job.launch_spec().objective is job.objective and job.launch_spec().device_memory_bytes == 3 * GiB
    with pytest.raises(AttributeError):
        job.min_mbs = 4  # frozen


def test_every_experiment_uses_the_smallest_slot_count_on_each_node(tmp_path):
    job = build(tmp_path, {"autotuning": {"mp_size": 2}},
                nodes=(Node("a", (0, 1, 2, 3)), Node("b", (0, 1))))
    assert (job.num_nodes, job.slots_per_node, job.world_size, job.dp_world_size) == (2, 2, 4, 2)


def test_min_train_batch_size_raises_the_smallest_mbs(tmp_path):
    job = build(tmp_path, {"autotuning": {"min_train_batch_size": 7}})
    assert job.min_mbs == 4  # ceil(7 / (gas 1 * DP 2))


def test_bounds_that_leave_no_mbs_are_an_error_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"leave no micro batch size: mbs 1\.\.0 .*batch: gas 1, "
                                          r"train_batch_size = mbs x 1 x DP 2"):
        build(tmp_path, {"autotuning": {"max_train_batch_size": 1}})


def test_arg_mappings_reach_every_launch(tmp_path):
    job = build(tmp_path, {"autotuning": {"arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"}}})
    assert job.arg_mappings == {"train_micro_batch_size_per_gpu": "--bs"}
    assert job.launch_spec().arg_mappings == (("train_micro_batch_size_per_gpu", "--bs"),)


def test_keys_zerotune_sets_itself_are_logged(tmp_path):
    job = build(tmp_path, {"autotuning": {"enabled": False, "metric_path": "/tmp/m.json"}})
    assert job.notes == ("autotuning.enabled = False is not used: zerotune sets it for each experiment",
                         "autotuning.metric_path = '/tmp/m.json' is not used: zerotune sets it for each experiment")


@pytest.mark.parametrize("options, message", [
    ({"timeout_s": -5.0}, r"--timeout -5: expected seconds from 1 to 10,000,000 \(about 115 days\)"),
    ({"backend": "pbs"}, r"unknown backend 'pbs': expected 'local', 'ray' or 'slurm'"),
    ({"device_memory_bytes": None}, r"--device-memory is required"),
])
def test_bad_options_are_errors(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        build(tmp_path, **options)


def test_model_info_from_the_config(tmp_path):
    job = build(tmp_path, {"autotuning": {"model_info": {"num_params": 1000, "activation_mem_per_gpu": 64}}})
    assert job.model_info.to_metrics() == {"num_params": 1000, "trainable_num_params": 1000,
                                           "activation_mem_per_gpu": 64}
    with pytest.raises(ConfigError, match=r"'autotuning.model_info.num_params' = 0: expected a positive integer"):
        build(tmp_path, {"autotuning": {"model_info": {"num_params": 0}}})


def test_a_numeric_train_batch_size_is_held_fixed(tmp_path):
    job = build(tmp_path, {"train_batch_size": 16, "gradient_accumulation_steps": 8})
    # DP 2: mbs divides 8, gas = 8 / mbs
    assert (job.min_mbs, job.max_mbs, job.allowed_mbs) == (1, 8, (1, 2, 4, 8))
    assert [job.batch.gas_for(m) for m in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert job.batch.gas_ladder(2) == []  # nothing to search: gas follows mbs
    assert job.batch.describe() == "batch: train_batch_size fixed at 16 (mbs x gas x DP 2); gas follows mbs"
    with pytest.raises(ConfigError, match=r"'train_batch_size' = 15: not divisible by the DP world size 2"):
        build(tmp_path, {"train_batch_size": 15})


def test_lists_of_mbs_and_gas_are_honoured(tmp_path):
    job = build(tmp_path, {"train_micro_batch_size_per_gpu": [8, 2, 32], "gradient_accumulation_steps": [1, 4, 2],
                           "autotuning": {"max_train_micro_batch_size_per_gpu": 16}})
    assert job.allowed_mbs == (2, 8) and (job.min_mbs, job.max_mbs) == (2, 8)
    assert job.batch.gas == 1 and job.batch.gas_ladder(8) == [4, 2]  # the config's order after the first


def test_gas_doubles_within_max_train_batch_size_or_once_without_it(tmp_path):
    job = build(tmp_path, {"autotuning": {"max_train_batch_size": 40}})
    assert job.max_mbs == 20 and job.batch.gas_ladder(4) == [2, 4]  # 4 x 4 x 2 = 32 <= 40 < 4 x 8 x 2
    assert build(tmp_path).batch.gas_ladder(4) == [2]  # no bound given: one doubling of the user's gas
    assert build(tmp_path, {"gradient_accumulation_steps": 3}).batch.gas_ladder(4) == [6]
    assert build(tmp_path, {"gradient_accumulation_steps": [1]}).batch.gas_ladder(4) == []  # held at 1
    # null is unset, as DeepSpeed reads it (found by tests/hostile/test_fuzz.py: it raised a TypeError)
    job = build(tmp_path, {"gradient_accumulation_steps": None})
    assert job.batch.gas == 1 and job.batch.gas_ladder(4) == [2]


def test_bad_batch_values_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"'gradient_accumulation_steps' = \[1, 0\]: expected a positive integer "
                                          r"or a list of them"):
        build(tmp_path, {"gradient_accumulation_steps": [1, 0]})


def test_an_empty_list_of_candidates_is_an_error_naming_the_file_and_key(tmp_path):
    # found by tests/hostile/test_fuzz.py: {"optimizer": []} failed only in the knob phase, with no file named
    for config, key in (({"optimizer": []}, "optimizer"), ({"zero_optimization": {"reduce_bucket_size": []}},
                                                           "zero_optimization.reduce_bucket_size")):
        with pytest.raises(ConfigError, match=rf"ds\.json: {key} = \[\]: a list in the config is a list of candidates "
                                              r"to tune; expected at least one"):
            build(tmp_path, config)
    build(tmp_path, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}})  # a list setting stays one


def test_a_sequence_parallel_group_counts_as_one_replica_in_the_train_batch_size(tmp_path):
    # DeepSpeed 0.19 on these 2 CPU ranks with sequence_parallel_size 2 ran train_batch_size 2 at mbs 2, gas 1, and
    # refused 4: "4 != 2 * 1 * 1.0" (docs/decisions.md D331); ZeRO still partitions over both ranks
    job = build(tmp_path, {"sequence_parallel_size": 2, "zero_optimization": {"stage": 1}})
    assert (job.dp_world_size, job.batch.dp_world_size) == (2, 1)
    cfg = ConfigBuilder(job).config(1, 2)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == \
        (2, 1, 2)


@pytest.mark.parametrize("sp, message", [
    (3, r"'sequence_parallel_size' = 3: 3 does not divide the DP world size 2 of each experiment"),
    ([1, 4], r"'sequence_parallel_size' = \[1, 4\]: 4 does not divide the DP world size 2 of each experiment"),
    ([1, 0], r"'sequence_parallel_size' = \[1, 0\]: expected a positive integer or a list of them"),
    (True, r"'sequence_parallel_size' = True: expected a positive integer or a list of them"),
    ("$SP", r"'sequence_parallel_size' = '\$SP': expected a positive integer or a list of them")])
def test_a_sequence_parallel_size_deepspeed_cannot_take_is_refused_naming_it(tmp_path, sp, message):
    with pytest.raises(ConfigError, match=str(tmp_path / "ds.json") + ": " + message):
        build(tmp_path, {"sequence_parallel_size": sp,
                         **({"autotuning": {"variables": {"SP": [1, 2]}}} if sp == "$SP" else {})})


def test_a_list_of_ulysses_degrees_builds_on_its_smallest_and_counts_each_degrees_replicas(tmp_path):
    job = build(tmp_path, {"sequence_parallel_size": [2, 1], "zero_optimization": {"stage": 1}})
    assert job.sp_degrees == (2,) and "sequence_parallel_size" not in job.user_config  # 1, DeepSpeed's default
    assert job.batch.dp_world_size == 2
    builder = ConfigBuilder(job)
    plain, ulysses = builder.config(1, 4), builder.config(1, 4, {"sequence_parallel_size": 2})
    # on 2 ranks: 4 x 1 x 2 samples a step at degree 1, 4 x 1 x 1 at degree 2 (one replica, D331)
    assert (plain["train_batch_size"], ulysses["train_batch_size"]) == (8, 4)
    assert (builder.name(plain), builder.name(ulysses)) == ("z1_gas1_tmbspg4", "z1_gas1_tmbspg4_sp2")
    # the knob phase on a Ulysses saver's best: its 9 stage-1 candidates keep the degree's batch count
    knobs = builder.knob_space(1, 4, settings={"sequence_parallel_size": 2})
    assert len(knobs) == 9 and {c.ds_config["train_batch_size"] for c in knobs} == {4}
    fixed = build(tmp_path, {"sequence_parallel_size": [1, 2], "train_batch_size": 8,
                             "zero_optimization": {"stage": 1}})
    assert ConfigBuilder(fixed).config(1, 2, {"sequence_parallel_size": 2})["gradient_accumulation_steps"] == 4


def test_autotp_at_stages_0_to_2_counts_every_rank_in_the_train_batch_size(tmp_path):
    # DeepSpeed 0.19, 2 CPU ranks, a 2-layer LLaMA with autotp_size 2: train_batch_size 4 at mbs 2, gas 1 trains at
    # ZeRO 1 and 2 (each rank holds 1,049,856 of 1,836,288 parameters); at ZeRO-3 it is refused, "4 != 2 * 1 * 1" (D331)
    job = build(tmp_path, {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": [1, 2]}})
    assert (job.stages, job.batch.dp_world_size) == ((1, 2), 2)
    assert ConfigBuilder(job).config(2, 2)["train_batch_size"] == 4
    assert job.autotp_degrees == ()


def test_a_list_of_autotp_degrees_builds_on_its_smallest_and_leaves_the_others_to_the_savers(tmp_path):
    job = build(tmp_path, {"tensor_parallel": {"autotp_size": [2, 1, 2]}, "zero_optimization": {"stage": 1}})
    assert job.autotp_degrees == (2,) and job.user_config["tensor_parallel"] == {"autotp_size": 1}
    assert ConfigBuilder(job).config(1, 2)["tensor_parallel"] == {"autotp_size": 1}


@pytest.mark.parametrize("config, message", [
    ({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": [1, 3]}},
     r"'tensor_parallel.autotp_size' = 2 with ZeRO stage 3 among the candidates \[1, 3\]: DeepSpeed counts ranks / "
     r"autotp_size in train_batch_size at stage 3"),
    ({"tensor_parallel": {"autotp_size": 4}}, r"'tensor_parallel.autotp_size' = 4: 4 does not divide the 2 rank\(s\)"),
    ({"tensor_parallel": {"autotp_size": [1, 4]}},
     r"'tensor_parallel.autotp_size' = \[1, 4\]: 4 does not divide the 2 rank\(s\)"),
    ({"tensor_parallel": {"autotp_size": [1, 2]}, "zero_optimization": {"stage": "all"}},
     r"'tensor_parallel.autotp_size' = \[1, 2\] with ZeRO stage 3 among the candidates \[0, 1, 2, 3\]"),
    ({"tensor_parallel": {"autotp_size": [1, "2"]}},
     r"'tensor_parallel.autotp_size' = \[1, '2'\]: expected a non-negative integer or a list of them"),
    ({"tensor_parallel": {"autotp_size": "$TP"}, "autotuning": {"variables": {"TP": [1, 2]}}},
     r"'tensor_parallel.autotp_size' = '\$TP': expected a non-negative integer")])
def test_an_autotp_size_zerotune_cannot_tune_is_refused_naming_it(tmp_path, config, message):
    with pytest.raises(ConfigError, match=str(tmp_path / "ds.json") + ": " + message):
        build(tmp_path, config)


@pytest.mark.parametrize("accelerator", ["cpu", None])
def test_cuda_is_decided_by_ds_accelerator_cpu_without_torch_else_by_torch(accelerator):
    """``DS_ACCELERATOR=cpu`` (DeepSpeed's override, which the ranks inherit) is CPU before torch is asked (it is not
    even imported); unset, torch decides (no CUDA on this machine)."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = ("import sys; from zerotune.inputs.job import cuda_available; "
            "print(cuda_available(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**env, **({"DS_ACCELERATOR": accelerator} if accelerator
                                                                      else {})}, capture_output=True, text=True)
    assert out.stdout.split() == (["False", "False"] if accelerator else ["False", "True"]), out.stderr[-2000:]
