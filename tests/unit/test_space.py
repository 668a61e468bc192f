"""Tests of zerotune.inputs.space (generation, order, dedupe, pruning, variables) and of the
checks it runs, zerotune.deepspeed.validate; names and hashes are in test_canonical.py."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.core.errors import ConfigError
from zerotune.deepspeed import keys
from zerotune.deepspeed.canonical import ACRONYMS, canonical_json, canonical_name, config_hash
from zerotune.deepspeed.validate import prune, validate
from zerotune.inputs.space import default_space, generate

ROOT = Path(__file__).resolve().parents[2]
Z = "zero_optimization"
ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999]}}}
MBS8 = {"train_micro_batch_size_per_gpu": 8}


def names(candidates):
    return [c.name for c in candidates]


# ---- default spaces and the 288-combination stage-3 space --------------------------------------


def test_default_space_sizes_per_stage():
    sizes = {}
    for stage in range(4):
        for offload in (False, True):
            sizes[stage, offload] = len(generate(ADAM, default_space(stage, offload), stage=stage,
                                                 dp_world_size=1))
    assert sizes == {(0, False): 1, (0, True): 1, (1, False): 9, (1, True): 18,
                     (2, False): 72, (2, True): 144, (3, False): 288, (3, True): 1152}
    # several CUDA nodes: ZeRO++'s quantized weights and gradients join stage 3 (x4), named qw and qg
    zeropp = generate(ADAM, default_space(3, zeropp=True), stage=3, dp_world_size=1)
    assert len(zeropp) == 1152 and len(generate(ADAM, default_space(1, zeropp=True), stage=1, dp_world_size=1)) == 9
    zero = zeropp[-1].ds_config["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"]) == (True, True)
    assert "_qw1_qg1" in canonical_name(zeropp[-1].ds_config)


Z3_NAMES_SHA256 = "6071510b26e37b21e8ecd7cf197d9e6317af92a2ae51fe9de700a2c218a01948"


def test_stage3_space_288_combinations_count_order_names():
    cands = generate({"train_micro_batch_size_per_gpu": 4}, default_space(3), stage=3, dp_world_size=1)
    got = names(cands)
    assert len(got) == 288 == len(set(got))
    # dimensions sorted by key path: overlap_comm, reduce_bucket_size, reduce_scatter,
    # stage3_max_live_parameters, stage3_max_reuse_distance, stage3_param_persistence_threshold,
    # stage3_prefetch_bucket_size (fastest); candidates in list order. Names leave out the values
    # at DeepSpeed's stage-3 defaults: overlap_comm and reduce_scatter on, reduce_bucket_size 5e8,
    # prefetch 5e7, persistence 1e5, max live parameters and reuse distance 1e9.
    assert got[:4] == [
        "z3_gas1_tmbspg4_rbs5e7_mlp1e8_mrd1e8",
        "z3_gas1_tmbspg4_rbs5e7_pfbs5e8_mlp1e8_mrd1e8",
        "z3_gas1_tmbspg4_rbs5e7_pfbs1e9_mlp1e8_mrd1e8",
        "z3_gas1_tmbspg4_rbs5e7_ppt1e6_mlp1e8_mrd1e8",
    ]
    assert got[24] == "z3_gas1_tmbspg4_rs0_rbs5e7_mlp1e8_mrd1e8"
    assert got[48] == "z3_gas1_tmbspg4_mlp1e8_mrd1e8"
    assert got[-1] == "z3_gas1_tmbspg4_oc0_rs0_rbs1e9_pfbs1e9_ppt1e6"
    assert hashlib.sha256("\n".join(got).encode()).hexdigest() == Z3_NAMES_SHA256
    first = cands[0]
    assert first.ds_config == {
        "train_micro_batch_size_per_gpu": 4,
        Z: {"stage": 3, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 50000000,
            "stage3_prefetch_bucket_size": 50000000, "stage3_param_persistence_threshold": 100000,
            "stage3_max_live_parameters": 100000000, "stage3_max_reuse_distance": 100000000},
    }
    assert sorted(first.knobs) == sorted(f"{Z}.{k}" for k in first.ds_config[Z] if k != "stage")
    assert all(c.fits for c in cands)


def test_order_independent_of_dict_insertion_order():
    space = default_space(3)
    reversed_space = {Z: dict(reversed(list(space[Z].items())))}
    base = {"train_micro_batch_size_per_gpu": 4}
    assert names(generate(base, reversed_space, stage=3, dp_world_size=1)) == \
        names(generate(base, space, stage=3, dp_world_size=1))


def test_order_independent_of_pythonhashseed():
    code = ("import hashlib; from zerotune.inputs.space import generate, default_space; "
            "n=[c.name for c in generate({'train_micro_batch_size_per_gpu': 4}, default_space(3), "
            "stage=3, dp_world_size=1)]; print(hashlib.sha256('\\n'.join(n).encode()).hexdigest())")
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == Z3_NAMES_SHA256


# ---- merge, dedupe, pruning -------------------------------------------------------------


def test_dedupe_5e8_equals_500000000():
    cands = generate(MBS8, {Z: {"reduce_bucket_size": [5e8, 500000000, 5e7]}}, stage=1, dp_world_size=1)
    assert names(cands) == ["z1_gas1_tmbspg8", "z1_gas1_tmbspg8_rbs5e7"]
    # the config to run keeps the default it spells (normalised to an int)
    assert cands[0].ds_config == {**MBS8, Z: {"stage": 1, "reduce_bucket_size": 500000000}}
    assert canonical_json({"a": 5e8}) == canonical_json({"a": 500000000}) == '{"a":500000000}'


def test_dedupe_explicit_default_equals_omitted():
    # reduce_bucket_size 5e8 is DeepSpeed's default: spelled out or left out, one config
    space = {Z: [{"reduce_bucket_size": 5e8}, {}, {"reduce_bucket_size": 5e7}, {"overlap_comm": False}]}
    cands = generate(MBS8, space, stage=2, dp_world_size=1)
    assert names(cands) == ["z2_gas1_tmbspg8", "z2_gas1_tmbspg8_rbs5e7"]
    assert [c.ds_config[Z] for c in cands] == [{"reduce_bucket_size": 500000000, "stage": 2},
                                              {"reduce_bucket_size": 50000000, "stage": 2}]
    assert config_hash(cands[0].ds_config) == config_hash({**MBS8, Z: {"stage": 2}})
    # overlap_comm False is the default at stage 2 only; at stage 3 the default is True
    z3 = generate(MBS8, {Z: [{}, {"overlap_comm": True}, {"overlap_comm": False}]}, stage=3, dp_world_size=1)
    assert names(z3) == ["z3_gas1_tmbspg8", "z3_gas1_tmbspg8_oc0"]


def test_pruning_removes_stage3_keys_from_stage1_and_collapses_variants():
    base = {**ADAM, "train_micro_batch_size_per_gpu": 2,
            Z: {"stage": 3, "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9,
                "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                "reduce_bucket_size": 5e8}}
    space = {Z: {"stage3_prefetch_bucket_size": [5e7, 5e8], "reduce_bucket_size": [5e7, 5e8]}}
    cands = generate(base, space, stage=1, dp_world_size=1)
    assert len(cands) == 2  # the 2 prefetch variants collapse after pruning
    for c in cands:
        zero = c.ds_config[Z]
        assert set(zero) == {"stage", "reduce_bucket_size", "offload_optimizer"}
        assert zero["offload_optimizer"] == {"device": "cpu"}  # the user's offload is kept
        assert c.ds_config["optimizer"] == ADAM["optimizer"]
    assert list(cands[0].knobs) == [f"{Z}.reduce_bucket_size"]


def test_pruning_stage0_keeps_only_stage_and_stage3_drops_stage12_keys():
    cfg = {Z: {"stage": 0, "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "cpu"}}}
    assert prune(cfg) == {Z: {"stage": 0}}
    cfg = {Z: {"stage": 3, "allgather_bucket_size": 5e8, "allgather_partitions": True,
               "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "cpu"}}}
    assert prune(cfg) == {Z: {"stage": 3, "reduce_bucket_size": 5e8,
                              "offload_optimizer": {"device": "cpu"}}}
    # DeepSpeed's own stage-3 space (144 combinations) holds only 24 distinct stage-3 configs.
    ds_z3 = {Z: {"stage": 3, "overlap_comm": [True, False], "reduce_scatter": [False, True],
                 "reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_partitions": [True, False],
                 "allgather_bucket_size": [5e7, 5e8, 1e9], "contiguous_gradients": [False, True]}}
    assert len(generate({}, ds_z3, stage=3, dp_world_size=1)) == 24


def test_space_overrides_only_named_keys_deep_merge():
    base = {**ADAM, Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    cands = generate(base, {Z: {"offload_optimizer": [{"device": "none"}, {"device": "cpu"}]}},
                     stage=2, dp_world_size=1)
    assert [c.ds_config[Z]["offload_optimizer"] for c in cands] == [
        {"device": "none", "pin_memory": True}, {"device": "cpu", "pin_memory": True}]
    assert [c.knobs for c in cands] == [{f"{Z}.offload_optimizer.device": "none"},
                                        {f"{Z}.offload_optimizer.device": "cpu"}]


def test_list_valued_settings_not_expanded_list_of_lists_is():
    base = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    one = generate(base, {"optimizer": {"params": {"betas": [0.9, 0.999]}}}, stage=0, dp_world_size=1)
    assert len(one) == 1 and one[0].ds_config["optimizer"]["params"]["betas"] == [0.9, 0.999]
    two = generate(base, {"optimizer": {"params": {"betas": [[0.9, 0.999], [0.9, 0.95]]}}},
                   stage=0, dp_world_size=1)
    assert [c.ds_config["optimizer"]["params"]["betas"] for c in two] == [[0.9, 0.999], [0.9, 0.95]]
    assert [c.knobs for c in two] == [{"optimizer.params.betas": [0.9, 0.999]},
                                      {"optimizer.params.betas": [0.9, 0.95]}]
    # a varying key without an acronym is not written into the name; the name carries the hash
    # (and a missing micro batch size is "tmbspg-")
    assert names(two) == [f"z0_gas1_tmbspg-_h{config_hash(c.ds_config)[:8]}" for c in two]


def test_list_settings_are_known_from_deepspeeds_config_models_and_taken_as_given():
    # compile.passes: CompileConfig's field is a list; lower_precision_safe_modules: read by hand, in the table
    base = {"compile": {"deepcompile": True, "passes": ["z3"]},
            "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]},
            Z: {"leaf_module": {"classes": ["MixtralSparseMoeBlock"]}}}
    one = generate(base, {}, stage=3, dp_world_size=1)
    assert len(one) == 1 and one[0].knobs == {}
    assert (one[0].ds_config["compile"]["passes"], one[0].ds_config["torch_autocast"]["lower_precision_safe_modules"],
            one[0].ds_config[Z]["leaf_module"]["classes"]) == (["z3"], ["torch.nn.Linear"], ["MixtralSparseMoeBlock"])
    assert [c.ds_config["compile"]["passes"] for c in generate(base, {"compile": {"passes": [["z3"], []]}},
                                                               stage=3, dp_world_size=1)] == [["z3"], []]
    assert keys.model_list_fields("compile") == {"passes"}
    assert {"leaf_module.classes", "leaf_module.names", "leaf_module.name_suffixes"} <= keys.model_list_fields(Z)
    # a knob DeepSpeed types as a number stays a list of candidates, without importing DeepSpeed to say so
    assert not keys.is_list_valued(f"{Z}.reduce_bucket_size") and not keys.is_list_valued("compile")
    assert not keys.is_list_valued(f"{Z}.offload_optimizer") and not keys.is_list_valued(f"{Z}.offload_param.device")


def test_generated_names_unique_when_values_format_alike():
    cands = generate({}, {"wandb": {"project": ["a-b", "a_b", "a b"]}, "steps_per_print": [10, "10"]},
                     stage=2, dp_world_size=1)
    assert len(cands) == 6 == len(set(names(cands)))
    # keys without an acronym: names differ by their hash only
    assert names(cands) == [f"z2_gas1_tmbspg-_h{config_hash(c.ds_config)[:8]}" for c in cands]


def test_autotuning_removed_and_train_batch_size_dropped_when_mbs_varies():
    base = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
            "autotuning": {"enabled": True, "metric": "throughput"}}
    cands = generate(base, {"train_micro_batch_size_per_gpu": [2, 4]}, stage=0, dp_world_size=4)
    assert [c.ds_config for c in cands] == [
        {"train_micro_batch_size_per_gpu": 2, Z: {"stage": 0}},
        {"train_micro_batch_size_per_gpu": 4, Z: {"stage": 0}}]
    assert names(cands) == ["z0_gas1_tmbspg2", "z0_gas1_tmbspg4"]
    # a fixed global batch named by the space is kept: DeepSpeed derives gas ("gas-", tbs named)
    fixed = generate({}, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": [2, 4, 8]},
                     stage=0, dp_world_size=4)
    assert [c.ds_config["train_batch_size"] for c in fixed] == [32, 32, 32]
    assert names(fixed) == [f"z0_gas-_tmbspg{m}_tbs32_h{config_hash(c.ds_config)[:8]}"
                            for m, c in zip((2, 4, 8), fixed)]
    with pytest.raises(ConfigError, match="train_batch_size = 32: not divisible by "
                                          "train_micro_batch_size_per_gpu × dp_world_size = 16 × 4"):
        generate({}, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": [2, 16]},
                 stage=0, dp_world_size=4)


def test_fits_false_kept_and_marked():
    cands = generate({}, {"train_micro_batch_size_per_gpu": [1, 2, 4, 8]}, stage=0, dp_world_size=1,
                     fits=lambda cfg: cfg["train_micro_batch_size_per_gpu"] <= 2)
    assert [(c.name, c.fits) for c in cands] == [
        ("z0_gas1_tmbspg1", True), ("z0_gas1_tmbspg2", True), ("z0_gas1_tmbspg4", False),
        ("z0_gas1_tmbspg8", False)]


def test_invalid_combination_is_an_error_not_a_drop():
    with pytest.raises(ConfigError, match=r"tuning space gives an invalid config "
                                          r"\(zero_optimization.reduce_bucket_size=0\): "
                                          r"zero_optimization.reduce_bucket_size = 0: expected a "
                                          r"positive integer"):
        generate({}, {Z: {"reduce_bucket_size": [5e8, 0]}}, stage=2, dp_world_size=1)
    with pytest.raises(ConfigError, match="empty list"):
        generate({}, {Z: {"reduce_bucket_size": []}}, stage=2, dp_world_size=1)
    with pytest.raises(ConfigError, match="tuning space zero_optimization.stage = 2, but generating stage 3"):
        generate({}, default_space(2), stage=3, dp_world_size=1)


def test_offload_space_needs_an_offloadable_optimizer():
    with pytest.raises(ConfigError, match=r"optimizer.type = 'SGD': zero_optimization.offload_optimizer "
                                          r"needs an optimizer DeepSpeed can run on the CPU"):
        generate({"optimizer": {"type": "SGD"}}, default_space(2, offload=True), stage=2,
                 dp_world_size=1)


# ---- variables --------------------------------------------------------------------------------


def test_variables_whole_value_keeps_type_and_inside_string():
    base = {Z: {"reduce_bucket_size": "$RBS", "offload_optimizer": {"device": "$DEV"}},
            "wandb": {"enabled": False, "project": "run_${DEV}_$$5"}, **ADAM}
    cands = generate(base, {}, stage=2, dp_world_size=1,
                     variables={"$RBS": [5e7, 500000000], "DEV": ["none", "cpu"]})
    assert len(cands) == 4
    # dimensions sorted: $DEV before $RBS; $DEV varies slowest
    got = [(c.ds_config[Z]["offload_optimizer"]["device"], c.ds_config[Z]["reduce_bucket_size"],
            c.ds_config["wandb"]["project"]) for c in cands]
    assert got == [("none", 50000000, "run_none_$5"), ("none", 500000000, "run_none_$5"),
                   ("cpu", 50000000, "run_cpu_$5"), ("cpu", 500000000, "run_cpu_$5")]
    assert all(type(c.ds_config[Z]["reduce_bucket_size"]) is int for c in cands)


def test_unresolved_and_unused_variables_are_named():
    with pytest.raises(ConfigError, match=r"unresolved variable \$MBS at train_micro_batch_size_per_gpu"):
        generate({"train_micro_batch_size_per_gpu": "$MBS"}, {}, stage=0, dp_world_size=1)
    with pytest.raises(ConfigError, match=r"variable \$GAS is not used"):
        generate({"train_micro_batch_size_per_gpu": "$MBS"}, {}, stage=0, dp_world_size=1,
                 variables={"MBS": [1], "GAS": [1, 2]})
    with pytest.raises(ConfigError, match=r"variable \$MBS = 4: expected a non-empty list"):
        generate({"train_micro_batch_size_per_gpu": "$MBS"}, {}, stage=0, dp_world_size=1,
                 variables={"MBS": 4})


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, dp, message", [
    ({Z: {"stage": 4}}, 1, "zero_optimization.stage = 4: expected 0, 1, 2 or 3"),
    ({Z: True}, 1, 'zero_optimization = True: expected an object such as {"stage": 2}'),
    ({"train_micro_batch_size_per_gpu": 0}, 1,
     "train_micro_batch_size_per_gpu = 0: expected a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2.5}, 1,
     "train_micro_batch_size_per_gpu = 2.5: expected a positive integer"),
    ({"gradient_accumulation_steps": -1}, 1,
     "gradient_accumulation_steps = -1: expected a positive integer or \"auto\""),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     "train_batch_size = 30: expected train_micro_batch_size_per_gpu × gradient_accumulation_steps × "
     "dp_world_size = 4 × 2 × 4 = 32"),
    ({Z: {"stage": 2, "reduce_bucket_size": 0}}, 1,
     "zero_optimization.reduce_bucket_size = 0: expected a positive integer (elements)"),
    ({Z: {"stage": 1, "allgather_bucket_size": 1.5e3 + 0.5}}, 1,
     "zero_optimization.allgather_bucket_size = 1500.5: expected a positive integer (elements)"),
    ({Z: {"stage": 3, "stage3_prefetch_bucket_size": -1}}, 1,
     "zero_optimization.stage3_prefetch_bucket_size = -1: expected a non-negative integer (elements)"),
    ({Z: {"stage": 1, "stage3_max_live_parameters": 1e9}}, 1,
     "zero_optimization.stage3_max_live_parameters applies only to ZeRO stage 3, but stage is 1"),
    ({Z: {"stage": 2, "offload_param": {"device": "cpu"}}}, 1,
     "zero_optimization.offload_param applies only to ZeRO stage 3, but stage is 2"),
    ({Z: {"stage": 3, "allgather_bucket_size": 5e8}}, 1,
     "zero_optimization.allgather_bucket_size applies only to ZeRO stages 1 and 2, but stage is 3"),
    ({Z: {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, 1,
     "zero_optimization.offload_optimizer applies only to ZeRO stages 1-3, but stage is 0"),
    ({Z: {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, 1,
     "zero_optimization.offload_optimizer.device = 'gpu': expected one of none, cpu, nvme"),
    ({Z: {"stage": 3, "offload_param": {"device": "nvme"}}}, 1,
     "zero_optimization.offload_param.device = 'nvme' needs zero_optimization.offload_param.nvme_path"),
    ({"optimizer": {"type": "Lamb"}, Z: {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, 1,
     "optimizer.type = 'Lamb': zero_optimization.offload_optimizer needs an optimizer DeepSpeed can "
     "run on the CPU (adam, adamw, adagrad, lion), or set \"zero_force_ds_cpu_optimizer\": false"),
    ({Z: {"stage": 3, "compute_grad_norm": False}}, 1,
     "zero_optimization.compute_grad_norm = false: supported only with ZeRO stage 1 or 2, but stage is 3"),
    ({}, 0, "dp_world_size = 0: expected a positive integer"),
])
def test_validate_messages(cfg, dp, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg, dp)
    assert str(e.value) == message


def test_validate_accepts_good_configs():
    validate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2, **ADAM,
              Z: {"stage": 2, "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "cpu"}}}, 4)
    validate({"train_batch_size": "auto", "gradient_accumulation_steps": "auto",
              "train_micro_batch_size_per_gpu": 4}, 8)
    validate({"optimizer": {"type": "SGD"}, "zero_force_ds_cpu_optimizer": False,
              Z: {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, 1)
    # a client optimizer (no optimizer section): DeepSpeed checks it at run time
    validate({Z: {"stage": 3, "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "cpu"}}}, 2)


# ---- DeepSpeed drift guard ---------------------------------------------------------------------


def test_known_zero_keys_exist_in_deepspeed():
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    fields = set()
    for name, f in zero_config.DeepSpeedZeroConfig.model_fields.items():
        fields.add(name)
        if f.alias:
            fields.add(f.alias)
    ours = set(keys.STAGE3_ONLY_KEYS) | set(keys.STAGE12_ONLY_KEYS) | set(keys.SIZE_KEYS)
    ours |= {k.split(".")[1] for k in ACRONYMS if k.startswith(Z + ".")}
    ours |= {k for stage_defaults in keys.ZERO_DEFAULTS.values() for k in stage_defaults}
    ours |= {k for s in range(4) for k in default_space(s, offload=True)[Z]}
    assert sorted(ours - fields) == []
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    assert [d.value for d in offload.OffloadDeviceEnum] == list(keys.OFFLOAD_DEVICES)
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    assert set(keys.OFFLOADABLE_OPTIMIZERS) <= set(ds_config.DEEPSPEED_OPTIMIZERS)


def test_the_savers_keys_beyond_zero_exist_in_deepspeed():
    """bf16 states (`zerotune.strategy.savers.BF16_STATES`) and the AutoTP degree are DeepSpeed's own fields."""
    from zerotune.strategy.savers import BF16_STATES, savers_for
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    assert set(BF16_STATES.settings["bf16"]) <= set(precision.DeepSpeedBF16Config.model_fields)
    tp_config = pytest.importorskip("deepspeed.runtime.tensor_parallel.config")
    (autotp,) = [s for s in savers_for(1, False, autotp=(2,)) if s.name == "autotp 2"]
    assert set(autotp.settings["tensor_parallel"]) <= set(tp_config.TPTrainingConfig.model_fields)
