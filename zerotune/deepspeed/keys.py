"""DeepSpeed's config keys as zerotune needs them: names, which stage reads which key, which keys hold lists,
integer sizes and their bounds, and DeepSpeed's defaults.

Facts only, each with its source in DeepSpeed 0.19 (``deepspeed/runtime/zero/config.py`` unless said otherwise),
read from here by the modules that check, name and generate configs.
"""
from __future__ import annotations

import collections.abc
import functools
import importlib
import sys
import types
import typing
from typing import Any

ZERO = "zero_optimization"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
TBS = "train_batch_size"
CHECKPOINTING = "gradient_checkpointing"
"""zerotune's own top-level key (DeepSpeed reads no such key and ignores it): whether the script recomputes
activations (a Hugging Face ``Trainer``'s ``--gradient_checkpointing``, passed by ``autotuning.arg_mappings``).
True: every checkpointable layer keeps only its input for the backward pass; absent or False: the script's
own default. The memory model prices it (`zerotune.model.memory`), the savers phase tunes it
(`zerotune.strategy.savers`)."""

# Keys whose DeepSpeed value is itself a list, where DeepSpeed reads them by hand (no config model to ask:
# MODEL_SECTIONS): a flat list there is the setting, a list of lists is a list of candidates. Dotted paths; a
# trailing ".*" covers a whole section.
LIST_VALUED_KEYS: tuple[str, ...] = (
    "optimizer.params.betas",
    "torch_autocast.lower_precision_safe_modules",  # deepspeed/runtime/config.py, get_torch_autocast_... by hand
    "scheduler.params.*",  # passed to the scheduler's constructor as is (client schedulers take lists)
    "comms_logger.prof_ops",
    "data_efficiency.*",
    "curriculum_learning.*",
    "compression_training.*",
    "sparse_attention.*",
    "keep_in_fp32_modules",
)

# Optimizer types (``optimizer.type``, case-insensitive) for which DeepSpeed builds a CPU optimizer
# when ``offload_optimizer.device`` is cpu or nvme (deepspeed/runtime/engine.py,
# _configure_basic_optimizer: adam/adamw -> DeepSpeedCPUAdam, adagrad -> DeepSpeedCPUAdagrad,
# lion -> DeepSpeedCPULion).
OFFLOADABLE_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "adagrad", "lion")

# deepspeed/runtime/zero/offload_config.py, OffloadDeviceEnum.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# zero_optimization keys read only by ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3 / Init), by
# their DeepSpeed alias and by field name.
STAGE3_ONLY_KEYS: frozenset[str] = frozenset({
    "offload_param",
    "sub_group_size",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "leaf_module",
    "save_muon_momentum_buffer_in_memory",
    "cpu_offload_param",
})  # plus every key starting with "stage3_" (is_stage3_only)

# zero_optimization keys read only by the stage 1/2 optimizer (DeepSpeedZeroOptimizer).
# ``allgather_partitions`` is read by no code at all in DeepSpeed 0.19; it is kept for stages 1/2
# because DeepSpeed documents it there, and never tuned by default.
STAGE12_ONLY_KEYS: frozenset[str] = frozenset({
    "allgather_bucket_size",
    "allgather_partitions",
    "round_robin_gradients",
    "use_multi_rank_bucket_allreduce",
    "parameter_alignment",
    "legacy_stage1",
})

# Integer sizes (elements) in zero_optimization: key -> smallest allowed value. DeepSpeed requires
# reduce_bucket_size > 0; a zero allgather bucket cannot gather anything, so it is refused too.
SIZE_KEYS: dict[str, int] = {
    "reduce_bucket_size": 1,
    "allgather_bucket_size": 1,
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "sub_group_size": 0,
}

# DeepSpeed 0.19's defaults for the zero_optimization knobs zerotune names (the zero_optimization
# keys of zerotune.deepspeed.canonical.ACRONYMS), by the key zerotune writes (the stage3_ alias where
# DeepSpeed has one): the field defaults of DeepSpeedZeroConfig in deepspeed/runtime/zero/config.py
# (``pp_int(5e8)`` is the int 500000000, ``pp_int(sys.maxsize)`` is sys.maxsize). The defaults are
# the same at every stage except ``overlap_comm``, whose field default is None and which the
# validator ``overlap_comm_valid`` sets to ``stage == 3``. Offload sections are left out on purpose:
# a section ``{"device": "none"}`` is not the same as no section (engine.py tests
# ``zero_offload_optimizer() is not None``).
_ZERO_DEFAULTS_ANY_STAGE: dict[str, Any] = {
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": sys.maxsize,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_allgather_sequential": False,
    "round_robin_gradients": False,
}

ZERO_DEFAULTS: dict[int, dict[str, Any]] = {
    stage: {**_ZERO_DEFAULTS_ANY_STAGE, "overlap_comm": stage == 3} for stage in (0, 1, 2, 3)
}
"""ZeRO stage -> zero_optimization key -> DeepSpeed's default value (ints and bools, no floats)."""


def is_stage3_only(key: str) -> bool:
    """Whether the zero_optimization key ``key`` is read only by ZeRO stage 3."""
    return key.startswith("stage3_") or key in STAGE3_ONLY_KEYS


MODEL_SECTIONS: dict[str, tuple[str, str]] = {
    ZERO: ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "tensor_parallel": ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
    "weight_quantization": ("deepspeed.inference.config", "WeightQuantConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
}
"""Sections DeepSpeed reads through a pydantic model (``deepspeed/runtime/config.py`` builds each from
``param_dict[section]``): whether a key there holds a list is the model field's type (`model_list_fields`)."""


def is_list_valued(path: str) -> bool:
    """Whether the dotted key ``path`` is a setting whose value is itself a list (``optimizer.params.betas``), so a flat
    list there is the setting, not candidates: in a section of `MODEL_SECTIONS` as its config model's field type says
    (DeepSpeed imported only for a key not known as a scalar), elsewhere as `LIST_VALUED_KEYS` says."""
    for rule in LIST_VALUED_KEYS:
        if rule.endswith(".*") and (path + ".").startswith(rule[:-1]):
            return True
        if path == rule:
            return True
    section, _, rest = path.partition(".")
    if section not in MODEL_SECTIONS or not rest or (section == ZERO and (
            rest in SIZE_KEYS or rest in ZERO_DEFAULTS[3] or rest == "stage"
            or rest.split(".")[0] in ("offload_optimizer", "offload_param"))):  # OffloadConfig: no list field
        return False
    return rest in model_list_fields(section)


@functools.lru_cache(maxsize=None)
def model_list_fields(section: str) -> frozenset[str]:
    """The keys (dotted under ``section``, by field name and alias, nested models followed) whose field type in
    DeepSpeed's config model for ``section`` is a list, tuple, set or sequence (an ``Optional`` of one included);
    empty where DeepSpeed or the model cannot be imported."""
    module, name = MODEL_SECTIONS[section]
    try:
        model = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not installed, or a DeepSpeed without the section: the table alone
        return frozenset()
    return frozenset(_list_fields(model, ""))


@functools.lru_cache(maxsize=None)
def model_fields(section: str) -> frozenset[str] | None:
    """Every key (field name and alias) of DeepSpeed's config model for ``section`` at its top level; None where
    DeepSpeed or the model cannot be imported."""
    module, name = MODEL_SECTIONS[section]
    try:
        model = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not installed, or a DeepSpeed without the section
        return None
    return frozenset(k for f_name, f in model.model_fields.items() for k in (f_name, f.alias or f_name))


def _list_fields(model, prefix: str) -> list[str]:
    found = []
    for field_name, field in model.model_fields.items():
        keys = {field_name, field.alias or field_name}
        if _is_list_type(field.annotation):
            found += [prefix + k for k in keys]
        for sub in _models_in(field.annotation):
            found += [path for k in keys for path in _list_fields(sub, f"{prefix}{k}.")]
    return found


def _is_list_type(annotation) -> bool:
    origin = typing.get_origin(annotation) or annotation
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set):
        return True
    return origin in (typing.Union, types.UnionType) and any(_is_list_type(a) for a in typing.get_args(annotation))


def _models_in(annotation) -> list[type]:
    """The pydantic models ``annotation`` names (itself, or the members of a union)."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)] \
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) else []


def candidate_lists(config: Any, path: str = "") -> list[tuple[str, list]]:
    """(dotted key, list) of each list of candidates (a tuning-space key) in a ds_config, in order: every list but
    the settings that are lists themselves (`is_list_valued`), ``autotuning`` and the keys the search owns
    (``zero_optimization.stage``, mbs, gas)."""
    if isinstance(config, dict):
        return [pair for key, value in config.items() if path or key != "autotuning"
                for pair in candidate_lists(value, f"{path}.{key}" if path else str(key))]
    if isinstance(config, list) and not is_list_valued(path) and path not in (f"{ZERO}.stage", MBS, GAS):
        return [(path, config)]
    return []


# DeepSpeed defaults (deepspeed/runtime/zero/config.py:113,222,228,245,251; engine.py:151).
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
DEFAULT_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_STAGE3_MAX_REUSE_DISTANCE = 1_000_000_000
DEFAULT_STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "lamb": 8, "onebitadam": 8,
                         "zerooneadam": 8, "onebitlamb": 8, "sgd": 4, "adagrad": 4, "lion": 4, "muon": 4}
"""Bytes of optimizer state per parameter by optimizer type (lower case, no ``_`` or ``-``): Adam's two moments."""


def optimizer_state_bytes(ds_config: dict[str, Any]) -> int:
    """Bytes of optimizer state per parameter, not counting an fp32 master copy (8 for Adam); an unknown or absent
    optimizer counts as Adam, the common and the larger case."""
    opt = ds_config.get("optimizer") or {}
    name = str(opt.get("type", "adam")).lower().replace("_", "").replace("-", "")
    return OPTIMIZER_STATE_BYTES.get(name, 8)
