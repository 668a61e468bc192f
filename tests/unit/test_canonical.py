"""Tests of zerotune.deepspeed.canonical: canonical text, defaults, hash and canonical names."""
from __future__ import annotations

import hashlib
import itertools
import re

import pytest

from zerotune.deepspeed.canonical import (
    ACRONYMS,
    canonical_json,
    canonical_name,
    config_hash,
    without_defaults,
)
from zerotune.deepspeed.keys import ZERO_DEFAULTS
from zerotune.inputs.space import generate

Z = "zero_optimization"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


def h8(cfg):
    return config_hash(cfg)[:8]


# ---- defaults and identity ----------------------------------------------------------------------


def test_without_defaults_exact():
    cfg = {MBS: 8, Z: {"stage": 3, "overlap_comm": True, "reduce_scatter": 0, "reduce_bucket_size": 5e8,
                       "stage3_prefetch_bucket_size": 5e7, "sub_group_size": 1e9 + 1,
                       "stage3_max_live_parameters": 1e8, "offload_optimizer": {"device": "none"}}}
    before = canonical_json(cfg)
    # 0 is not False: only a bool equals a bool default; a {"device": "none"} section is kept
    assert without_defaults(cfg) == {MBS: 8, Z: {"stage": 3, "reduce_scatter": 0, "sub_group_size": 1000000001,
                                                 "stage3_max_live_parameters": 100000000,
                                                 "offload_optimizer": {"device": "none"}}}
    assert canonical_json(cfg) == before  # not modified
    # overlap_comm's default depends on the stage (DeepSpeed's overlap_comm_valid: stage == 3)
    assert without_defaults({Z: {"stage": 2, "overlap_comm": True}}) == {Z: {"stage": 2, "overlap_comm": True}}
    assert without_defaults({Z: {"stage": 2, "overlap_comm": False}}) == {Z: {"stage": 2}}
    assert without_defaults({Z: {"overlap_comm": False}}) == {Z: {}}  # no stage: DeepSpeed's 0
    # an unknown stage: nothing is a default
    assert without_defaults({Z: {"stage": 9, "overlap_comm": False}}) == {Z: {"stage": 9, "overlap_comm": False}}


def test_explicit_defaults_same_hash_and_name_as_omitted():
    plain = {MBS: 8, Z: {"stage": 1}}
    spelled = {MBS: 8, Z: {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 500000000,
                           "overlap_comm": False, "reduce_scatter": True, "contiguous_gradients": True,
                           "round_robin_gradients": False}}
    assert canonical_name(spelled) == canonical_name(plain) == "z1_gas1_tmbspg8"
    assert config_hash(spelled) == config_hash(plain) == hashlib.sha256(
        b'{"train_micro_batch_size_per_gpu":8,"zero_optimization":{"stage":1}}').hexdigest()
    # canonical_json stays the literal text
    assert canonical_json(spelled) != canonical_json(plain)
    assert canonical_json({"a": 5e8}) == canonical_json({"a": 500000000}) == '{"a":500000000}'
    # every stage-3 default spelled out
    z3 = {MBS: 4, Z: {"stage": 3, **ZERO_DEFAULTS[3]}}
    assert canonical_name(z3) == "z3_gas1_tmbspg4"
    assert config_hash(z3) == config_hash({MBS: 4, Z: {"stage": 3}})
    # a value that is not the default is named and hashed
    assert canonical_name({MBS: 8, Z: {"stage": 1, "reduce_bucket_size": 5e7}}) == "z1_gas1_tmbspg8_rbs5e7"
    assert config_hash({MBS: 8, Z: {"stage": 1, "reduce_bucket_size": 5e7}}) != config_hash(plain)


def test_zero_defaults_are_deepspeeds():
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    by_alias = {f.alias or name: name for name, f in zero_config.DeepSpeedZeroConfig.model_fields.items()}
    for stage, defaults in ZERO_DEFAULTS.items():
        ds = zero_config.DeepSpeedZeroConfig(stage=stage)
        got = {key: getattr(ds, by_alias[key]) for key in defaults}
        assert got == defaults
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in defaults.items()}
    assert ZERO_DEFAULTS[3]["overlap_comm"] is True and ZERO_DEFAULTS[2]["overlap_comm"] is False
    assert ZERO_DEFAULTS[1]["reduce_bucket_size"] == 500_000_000


# ---- names --------------------------------------------------------------------------------------


def test_names_in_deepspeeds_style():
    assert canonical_name({MBS: 8, Z: {"stage": 1}}) == "z1_gas1_tmbspg8"
    assert canonical_name({MBS: 8, GAS: 1, Z: {"stage": 1}}) == "z1_gas1_tmbspg8"
    cfg = {MBS: 8, GAS: 2, Z: {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7}}
    assert canonical_name(cfg) == "z2_gas2_tmbspg8_oc1_rbs5e7"
    shuffled = {Z: {"reduce_bucket_size": 50000000, "overlap_comm": True, "stage": 2}, GAS: 2, MBS: 8}
    assert canonical_name(shuffled) == "z2_gas2_tmbspg8_oc1_rbs5e7"
    z3 = {MBS: 4, Z: {"stage": 3, "reduce_bucket_size": 1e7, "stage3_prefetch_bucket_size": 1e7,
                      "stage3_max_live_parameters": 1e7}}
    assert canonical_name(z3) == "z3_gas1_tmbspg4_rbs1e7_pfbs1e7_mlp1e7"
    # train_batch_size is mbs × gas × DP when both are set: not repeated
    assert canonical_name({MBS: 8, GAS: 2, "train_batch_size": 64, Z: {"stage": 1}}) == "z1_gas2_tmbspg8"
    # settings not named (fixed for a whole job) do not add the hash
    assert canonical_name({**cfg, "fp16": {"enabled": False}, "optimizer": {"type": "Adam"}}) == \
        "z2_gas2_tmbspg8_oc1_rbs5e7_fp0"
    assert canonical_name({**cfg, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}) == \
        "z2_gas2_tmbspg8_oc1_rbs5e7"


def test_lossy_value_adds_hash():
    cfg = {MBS: 8, Z: {"stage": 1, "reduce_bucket_size": 5e8 + 0.5}}
    assert canonical_name(cfg) == f"z1_gas1_tmbspg8_rbs500000000.5_h{h8(cfg)}"
    assert re.fullmatch(r"z1_gas1_tmbspg8_rbs500000000\.5_h[0-9a-f]{8}", canonical_name(cfg))
    upper = {MBS: 8, Z: {"stage": 2, "offload_optimizer": {"device": "CPU"}}}
    assert canonical_name(upper) == f"z2_gas1_tmbspg8_ooCPU_h{h8(upper)}"
    lower = {MBS: 8, Z: {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert canonical_name(lower) == "z2_gas1_tmbspg8_oocpu"
    as_text = {MBS: "8", Z: {"stage": 1}}
    assert canonical_name(as_text) == f"z1_gas1_tmbspg8_h{h8(as_text)}"
    # a missing mbs, a gas DeepSpeed derives from train_batch_size, an unknown stage
    assert canonical_name({Z: {"stage": 1}}) == f"z1_gas1_tmbspg-_h{h8({Z: {'stage': 1}})}"
    derived = {MBS: 4, "train_batch_size": 32, Z: {"stage": 0}}
    assert canonical_name(derived) == f"z0_gas-_tmbspg4_tbs32_h{h8(derived)}"
    assert canonical_name({MBS: 4, Z: {"stage": 7}}) == f"z-_gas1_tmbspg4_h{h8({MBS: 4, Z: {'stage': 7}})}"
    # a huge integral number (1e142 is read as an int of 143 digits): cut to 24 digits, the hash names it
    huge = {MBS: 1, Z: {"stage": 3}, "fp16": {"enabled": 1e142}}
    assert canonical_name(huge) == f"z3_gas1_tmbspg1_fp{int(1e142)!s:.24}_h{h8(huge)}"
    assert canonical_name({**huge, "fp16": {"enabled": 1e143}}) != canonical_name(huge)


def test_extra_keys_add_hash():
    cfg = {MBS: 8, Z: {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}
    assert canonical_name(cfg) == "z2_gas1_tmbspg8"
    assert canonical_name(cfg, extra_keys=["optimizer.params.lr"]) == f"z2_gas1_tmbspg8_h{h8(cfg)}"
    assert canonical_name(cfg, extra_keys=["optimizer"]) == f"z2_gas1_tmbspg8_h{h8(cfg)}"  # a section
    assert canonical_name(cfg, extra_keys=["optimizer.params.eps"]) == "z2_gas1_tmbspg8"  # not set here
    assert canonical_name(cfg, extra_keys=["optimizer.params.l"]) == "z2_gas1_tmbspg8"  # not a prefix match


def test_number_formatting():
    def name(v):
        return canonical_name({MBS: 1, Z: {"stage": 1, "reduce_bucket_size": v}})
    assert [name(v) for v in (5e7, 1e6, 1024, 4096, 1500, 123456789, 20000)] == [
        f"z1_gas1_tmbspg1_rbs{t}" for t in ("5e7", "1e6", "1024", "4096", "1500", "123456789", "2e4")]


def test_acronym_table_collision_free():
    acronyms = [a for a, _ in ACRONYMS.values()]
    assert acronyms[:2] == ["tmbspg", "gas"]
    assert len(set(acronyms)) == len(acronyms)
    for a, b in itertools.permutations(acronyms, 2):
        assert not b.startswith(a), (a, b)
    assert not any(a[0] in "zh" or a[-1].isdigit() for a in acronyms)
    assert all(re.fullmatch(r"[a-z]+", a) for a in acronyms)


def test_hostile_keys_and_values_never_reach_a_name():
    cands = generate({MBS: 4}, {"../../../ESCAPED": [1, "../x", ["..", "/"], {"a/../b": ".."}]},
                     stage=1, dp_world_size=1)
    assert [c.name for c in cands] == [f"z1_gas1_tmbspg4_h{h8(c.ds_config)}" for c in cands]
    hostile = [{MBS: "../../..", GAS: "/etc", Z: {"stage": "../..", "offload_optimizer": {"device": "../../x"}},
                "fp16": {"enabled": "../.."}, "../../../ESCAPED": {"..": "/"}},
               {MBS: 4, Z: {"stage": 2, "reduce_bucket_size": [".", "..", "/", 1.5]}}]
    names = [c.name for c in cands] + [canonical_name(cfg, ["../../../ESCAPED"]) for cfg in hostile]
    assert names[4:] == [f"z-_gas-etc_tmbspg-_oo-x_fp-_h{h8(hostile[0])}",
                         f"z2_gas1_tmbspg4_rbs------1.5_h{h8(hostile[1])}"]
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", name), name
        assert "/" not in name and ".." not in name and "ESCAPED" not in name
    assert len(set(names)) == len(names)


def test_names_never_collide_property():
    """Over values that format alike (True/1, "1"/1, 5e8/"5e8", 8/"8"...) and a varying key without
    an acronym (given as extra_keys), configs that differ without defaults get different names
    and configs that do not get the same name."""
    pool = {
        f"{Z}.overlap_comm": [True, False, 1, 0, "1", None],
        f"{Z}.reduce_bucket_size": [5e8, 500000000, "5e8", 5e8 + 0.5, 1, True, 5e7],
        f"{Z}.offload_optimizer.device": ["cpu", "none", "CPU", "c_pu", 0],
        "optimizer.params.lr": [0.1, "0.1", 1e-4],
        MBS: [8, 8.0, "8"],
        GAS: [2, 2.0, "2"],
    }
    extra = ["optimizer.params.lr"]
    by_name: dict[str, str] = {}
    by_identity: dict[str, str] = {}
    keys = list(pool)
    for values in itertools.product(*(pool[k] + ["<absent>"] for k in keys)):
        cfg: dict = {Z: {"stage": 2}}
        for key, value in zip(keys, values):
            if value == "<absent>":
                continue
            d = cfg
            *parents, leaf = key.split(".")
            for p in parents:
                d = d.setdefault(p, {})
            d[leaf] = value
        name = canonical_name(cfg, extra)
        identity = canonical_json(without_defaults(cfg))
        assert by_name.setdefault(name, identity) == identity, name
        assert by_identity.setdefault(identity, name) == name, identity
    assert len(by_name) == len(by_identity) == 7776  # of 21504 configs
