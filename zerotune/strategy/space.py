"""Tuning spaces: from a user's ds_config and a space of candidates to a list of experiments.

A *tuning space* is a dict shaped like a ds_config in which any value may be a list of
candidates::

    {"zero_optimization": {"reduce_bucket_size": [5e7, 5e8]},
     "train_micro_batch_size_per_gpu": [2, 4, 8]}

:func:`generate` turns a base config (the user's own settings, possibly a template with ``$VAR``
placeholders) and a space into :class:`Candidate` configs: the Cartesian product of every list in
the space (and of every variable), deep-merged over the base config, pruned of the settings the
ZeRO stage ignores, deduplicated, validated and given a canonical name. This module is pure logic:
it never launches anything.

Which lists are candidates
--------------------------
Every list in the space is a list of candidates, except at the keys DeepSpeed itself expects a
list (:data:`LIST_VALUED_KEYS`, e.g. ``optimizer.params.betas``): there a flat list is the
setting itself (``"betas": [0.9, 0.999]`` is kept as is) and only a list of lists is a list of
candidates (``"betas": [[0.9, 0.999], [0.9, 0.95]]`` tunes betas). Lists in the *base* config are
always settings, never candidates. A candidate is taken as a whole value: lists inside it are not
expanded again (a dict candidate is deep-merged like any other value).

Variables
---------
``$NAME`` (or ``${NAME}``) in a string value of the base config or the space is a placeholder for
a variable given to :func:`generate` as ``variables={"NAME": [candidates...]}``; each variable is
one more dimension. A string that is exactly one placeholder takes the candidate itself (an int
stays an int, a dict stays a dict); a placeholder inside a longer string is replaced by the
candidate's text (``"offload_$DEV"``). ``$$`` is a literal ``$``. A placeholder without a variable,
and a variable without a placeholder, are errors (:class:`~zerotune.core.errors.ConfigError`).

Order
-----
Dimensions are sorted by their path (variables ``$NAME`` sort before config keys), candidates are
taken in the order given, and the last dimension varies fastest. The order depends on nothing
else (not on dict insertion order, not on ``PYTHONHASHSEED``); duplicates keep their first place.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from zerotune.core.errors import ConfigError

__all__ = [
    "ACRONYMS",
    "Candidate",
    "LIST_VALUED_KEYS",
    "OFFLOADABLE_OPTIMIZERS",
    "canonical_json",
    "canonical_name",
    "config_hash",
    "default_space",
    "generate",
    "is_list_valued",
    "prune",
    "validate",
]

ZERO = "zero_optimization"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
TBS = "train_batch_size"

# Keys whose DeepSpeed value is itself a list: a flat list there is the setting, a list of lists is
# a list of candidates. Dotted paths; a trailing ".*" covers a whole section.
LIST_VALUED_KEYS: tuple[str, ...] = (
    "optimizer.params.betas",
    "scheduler.params.*",  # passed to the scheduler's constructor as is (client schedulers take lists)
    "zero_optimization.leaf_module.classes",
    "zero_optimization.leaf_module.names",
    "zero_optimization.leaf_module.name_suffixes",
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

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# zero_optimization keys read only by ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3 / Init), by
# their DeepSpeed alias and by field name. deepspeed/runtime/zero/config.py.
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
})  # plus every key starting with "stage3_"

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

# Integer sizes (elements): key -> smallest allowed value. DeepSpeed requires reduce_bucket_size > 0;
# a zero allgather bucket cannot gather anything, so it is refused too.
_SIZE_KEYS: dict[str, int] = {
    "reduce_bucket_size": 1,
    "allgather_bucket_size": 1,
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "sub_group_size": 0,
}

# Canonical-name acronyms, in the order they appear in a name. Collision-free by construction:
# unique and prefix-free (no acronym starts another), none starts with "z" (the stage) or "h" (the
# hash) or ends with a digit (values follow); tests check this. Each has a kind: only a value of
# that kind is written losslessly.
# DeepSpeed's own table (autotuning/utils.py) maps several keys to the same acronym.
ACRONYMS: dict[str, tuple[str, str]] = {
    "zero_optimization.overlap_comm": ("oc", "bool"),
    "zero_optimization.reduce_scatter": ("rs", "bool"),
    "zero_optimization.contiguous_gradients": ("cg", "bool"),
    "zero_optimization.allgather_partitions": ("agp", "bool"),
    "zero_optimization.reduce_bucket_size": ("rbs", "int"),
    "zero_optimization.allgather_bucket_size": ("agbs", "int"),
    "zero_optimization.round_robin_gradients": ("rrg", "bool"),
    "zero_optimization.use_multi_rank_bucket_allreduce": ("mrar", "bool"),
    "zero_optimization.stage3_prefetch_bucket_size": ("pfbs", "int"),
    "zero_optimization.stage3_param_persistence_threshold": ("ppt", "int"),
    "zero_optimization.stage3_model_persistence_threshold": ("mpt", "int"),
    "zero_optimization.stage3_max_live_parameters": ("mlp", "int"),
    "zero_optimization.stage3_max_reuse_distance": ("mrd", "int"),
    "zero_optimization.sub_group_size": ("sgs", "int"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": ("arfp", "bool"),
    "zero_optimization.stage3_allgather_sequential": ("agseq", "bool"),
    "zero_optimization.offload_optimizer.device": ("oo", "str"),
    "zero_optimization.offload_optimizer.pin_memory": ("pino", "bool"),
    "zero_optimization.offload_param.device": ("op", "str"),
    "zero_optimization.offload_param.pin_memory": ("pinp", "bool"),
    "fp16.enabled": ("fp", "bool"),
    "bf16.enabled": ("bf", "bool"),
    "activation_checkpointing.partition_activations": ("pact", "bool"),
    "activation_checkpointing.cpu_checkpointing": ("cpuck", "bool"),
    MBS: ("mbs", "int"),
    GAS: ("gas", "int"),
    TBS: ("tbs", "int"),
}
_ALWAYS_NAMED = (MBS, GAS)  # in every name where the config sets them
_NAME_HASH_CHARS = 8

_PLACEHOLDER = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_WHOLE_PLACEHOLDER = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_LOSSLESS_STR = re.compile(r"[a-z][a-z0-9]*")


@dataclass(frozen=True)
class Candidate:
    """One configuration of a tuning space.

    Attributes:
        name: canonical name (:func:`canonical_name`), unique among configs.
        ds_config: the complete DeepSpeed config to run. Shared, do not mutate (copy it).
        knobs: dotted key -> value for the settings that differ between the configs of the space
            this candidate came from (a setting absent from this config is left out).
        fits: False when the memory model predicts it does not fit; such candidates are listed
            (a dry run shows them) but the tuners never propose them.
    """

    name: str
    ds_config: dict[str, Any] = field(compare=False, repr=False)
    knobs: dict[str, Any] = field(compare=False)
    fits: bool = True


# --------------------------------------------------------------------------------------------
# Canonical form, hash and names


def _normalize(value: Any) -> Any:
    """Numbers in canonical form: a float with an integral value becomes an int (5e8 == 500000000)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return int(value)
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def canonical_json(ds_config: dict[str, Any]) -> str:
    """The config as JSON with sorted keys, no whitespace and normalised numbers.

    Two configs DeepSpeed reads the same way (``5e8`` and ``500000000``, any key order) give the
    same text; it is what dedupe, :func:`config_hash` and names are based on.
    """
    return json.dumps(_normalize(ds_config), sort_keys=True, separators=(",", ":"))


def config_hash(ds_config: dict[str, Any]) -> str:
    """SHA-256 (hex, 64 characters) of :func:`canonical_json`; names carry its first 8 characters."""
    return hashlib.sha256(canonical_json(ds_config).encode()).hexdigest()


def _leaves(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for each leaf; lists and empty dicts are leaves."""
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, path + ".")
        else:
            yield path, v


def _get(d: dict[str, Any], path: str, default: Any = None) -> Any:
    cur: Any = d
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return default
        cur = cur[k]
    return cur


def _format_int(n: int) -> str:
    """Compact, exact: powers of two as is, ``m`` × 10^k (k >= 3) as ``mek`` (5e8, 1e6)."""
    if n > 0 and n & (n - 1) == 0:
        return str(n)
    if n != 0:
        m, k = abs(n), 0
        while m % 10 == 0:
            m //= 10
            k += 1
        if k >= 3:
            return f"{'-' if n < 0 else ''}{m}e{k}"
    return str(n)


def _format_float(x: float) -> str:
    s = repr(x)  # shortest text that round-trips
    return s.replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _format_value(value: Any, kind: str | None) -> tuple[str, bool]:
    """(text, lossless): lossless when the text identifies the value among values of ``kind``."""
    value = _normalize(value)
    if isinstance(value, bool):
        return ("1" if value else "0"), kind == "bool"
    if isinstance(value, int):
        return _format_int(value), kind == "int"
    if isinstance(value, float):
        return _format_float(value), False
    if isinstance(value, str):
        if kind == "str" and _LOSSLESS_STR.fullmatch(value):
            return value, True
        return re.sub(r"[^A-Za-z0-9.+-]+", "-", value) or "-", False
    if value is None:
        return "null", False
    if isinstance(value, list):
        return "-".join(_format_value(v, None)[0] for v in value) or "-", False
    return "-", False


def canonical_name(ds_config: dict[str, Any], knobs: Iterable[str] | None = None) -> str:
    """A readable name that no other config shares, e.g. ``z2_oc1_rbs5e8_mbs8_gas2``.

    The name is the stage (``z2``), then ``acronym + value`` for each named setting in the fixed
    order of :data:`ACRONYMS` (unknown keys after them by full dotted path, ``path=value``):
    numbers compact (``5e8``, ``1e6``, powers of two as is), booleans ``1``/``0``.

    Args:
        ds_config: the config to name.
        knobs: dotted keys to name (those that vary in a space). None names every key of
            :data:`ACRONYMS` present. The micro batch size and gradient accumulation steps are
            always named when the config sets them.

    Returns:
        The name. When the readable part does not determine the whole config (a setting not
        named, an unknown key, a value whose text is not exact) ``_h`` and the first 8 hex digits
        of :func:`config_hash` are appended, so two different configs never share a name.
    """
    leaves = dict(_leaves(ds_config))
    if knobs is None:
        named = {k for k in ACRONYMS if k in leaves}
    else:
        named = {k for k in knobs if k in leaves}
    named |= {k for k in _ALWAYS_NAMED if k in leaves}
    named.discard(f"{ZERO}.stage")

    stage = _get(ds_config, f"{ZERO}.stage")
    lossless = isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3
    parts = [f"z{stage}" if lossless else "z-"]
    order = list(ACRONYMS)
    for key in sorted(named, key=lambda k: (order.index(k), "") if k in ACRONYMS else (len(order), k)):
        if key in ACRONYMS:
            acronym, kind = ACRONYMS[key]
            text, exact = _format_value(leaves[key], kind)
            parts.append(f"{acronym}{text}")
        else:
            text, exact = _format_value(leaves[key], None)
            parts.append(f"{key}={text}")
            exact = False
        lossless = lossless and exact
    omitted = set(leaves) - named - {f"{ZERO}.stage"}
    if omitted or not lossless:
        parts.append("h" + config_hash(ds_config)[:_NAME_HASH_CHARS])
    return "_".join(parts)


# --------------------------------------------------------------------------------------------
# Default spaces

_BUCKETS = [5e7, 5e8, 1e9]  # elements; DeepSpeed's autotuning/constants.py


def default_space(stage: int, offload: bool = False) -> dict[str, Any]:
    """zerotune's default tuning space for a ZeRO stage (the micro batch size is added by search).

    Started from DeepSpeed's (autotuning/constants.py), keeping only knobs the stage reads:

    - stage 0: nothing to tune (the micro batch size only).
    - stage 1: reduce_bucket_size × allgather_bucket_size (9).
    - stage 2: + overlap_comm, reduce_scatter, contiguous_gradients (72).
    - stage 3: overlap_comm, reduce_scatter, reduce_bucket_size, stage3_prefetch_bucket_size,
      stage3_param_persistence_threshold, stage3_max_live_parameters,
      stage3_max_reuse_distance (288). DeepSpeed also tunes allgather_partitions and
      allgather_bucket_size here, but stage 3 reads neither (they would only repeat experiments).

    Args:
        stage: ZeRO stage, 0..3.
        offload: add ``offload_optimizer.device`` in [none, cpu] where the stage allows it
            (1, 2, 3) and ``offload_param.device`` in [none, cpu] for stage 3 (×2 / ×4). Offload
            needs an optimizer DeepSpeed can run on the CPU (:data:`OFFLOADABLE_OPTIMIZERS`);
            :func:`generate` refuses the space otherwise.

    Returns:
        A new dict (safe to modify).
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero["reduce_bucket_size"] = list(_BUCKETS)
        zero["allgather_bucket_size"] = list(_BUCKETS)
    if stage == 2:
        zero["overlap_comm"] = [True, False]
        zero["reduce_scatter"] = [True, False]
        zero["contiguous_gradients"] = [True, False]
    if stage == 3:
        zero["overlap_comm"] = [True, False]
        zero["reduce_scatter"] = [True, False]
        zero["reduce_bucket_size"] = list(_BUCKETS)
        zero["stage3_prefetch_bucket_size"] = list(_BUCKETS)
        zero["stage3_param_persistence_threshold"] = [1e5, 1e6]
        zero["stage3_max_live_parameters"] = [1e8, 1e9]
        zero["stage3_max_reuse_distance"] = [1e8, 1e9]
    if offload and stage >= 1:
        zero["offload_optimizer"] = {"device": ["none", "cpu"]}
    if offload and stage == 3:
        zero["offload_param"] = {"device": ["none", "cpu"]}
    return {ZERO: zero}


# --------------------------------------------------------------------------------------------
# Pruning and validation


def _is_stage3_only(key: str) -> bool:
    return key.startswith("stage3_") or key in STAGE3_ONLY_KEYS


def prune(ds_config: dict[str, Any]) -> dict[str, Any]:
    """Remove the zero_optimization settings its stage does not read (returns a new dict).

    Stage 0 keeps only ``stage``; stages 1 and 2 lose the stage-3-only keys (``stage3_*``,
    ``offload_param``, ``sub_group_size``... :data:`STAGE3_ONLY_KEYS`); stage 3 loses the
    stage-1/2-only keys (:data:`STAGE12_ONLY_KEYS`). ``offload_optimizer`` stays for stages 1-3.
    Keys zerotune does not know are kept.
    """
    cfg = copy.deepcopy(ds_config)
    zero = cfg.get(ZERO)
    if not isinstance(zero, dict):
        return cfg
    stage = zero.get("stage", 0)
    if stage == 0:
        cfg[ZERO] = {"stage": 0} if "stage" in zero else {}
    elif stage in (1, 2):
        cfg[ZERO] = {k: v for k, v in zero.items() if not _is_stage3_only(k)}
    elif stage == 3:
        cfg[ZERO] = {k: v for k, v in zero.items() if k not in STAGE12_ONLY_KEYS}
    return cfg


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _is_int(value: Any) -> bool:
    """An int, or a float with an integral value (5e8); not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value) and value == int(value)


def validate(ds_config: dict[str, Any], dp_world_size: int) -> None:
    """Check a config before anything runs; raise :class:`ConfigError` naming key, value, expectation.

    Checks:
        - ``zero_optimization`` is a dict and its ``stage`` is 0, 1, 2 or 3;
        - ``train_micro_batch_size_per_gpu`` is a positive int; ``gradient_accumulation_steps``
          and ``train_batch_size`` are positive ints or ``"auto"`` (filled in by the HF Trainer);
        - ``train_batch_size == mbs × gas × dp_world_size`` when all three are given (when one
          of mbs/gas is missing DeepSpeed derives it, so the product of the others must divide);
        - bucket sizes are positive integers, stage-3 sizes and thresholds non-negative integers;
        - stage-specific keys only where the stage reads them (stage 0: none; ``stage3_*``,
          ``offload_param``... only stage 3; ``allgather_bucket_size``... only stages 1/2);
        - offload devices are none/cpu/nvme, nvme needs ``nvme_path``; optimizer offload needs
          an optimizer DeepSpeed can run on the CPU (:data:`OFFLOADABLE_OPTIMIZERS`) unless the
          optimizer is the client's (no ``optimizer`` section: DeepSpeed then requires
          DeepSpeedCPUAdam/CPULion, which zerotune cannot see) or
          ``zero_force_ds_cpu_optimizer`` is false.

    Args:
        ds_config: the config to check (not modified).
        dp_world_size: data-parallel world size (ranks / model-parallel size).
    """
    if not _positive_int(dp_world_size):
        raise ConfigError(f"dp_world_size = {dp_world_size!r}: expected a positive integer")
    if not isinstance(ds_config, dict):
        raise ConfigError(f"ds_config: expected a JSON object, got {type(ds_config).__name__}")

    zero = ds_config.get(ZERO, {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{ZERO} = {zero!r}: expected an object such as {{\"stage\": 2}}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"{ZERO}.stage = {stage!r}: expected 0, 1, 2 or 3")

    mbs, gas, tbs = ds_config.get(MBS), ds_config.get(GAS), ds_config.get(TBS)
    if mbs is not None and not _positive_int(mbs):
        raise ConfigError(f"{MBS} = {mbs!r}: expected a positive integer")
    for key, value in ((GAS, gas), (TBS, tbs)):
        if value is not None and value != "auto" and not _positive_int(value):
            raise ConfigError(f"{key} = {value!r}: expected a positive integer or \"auto\"")
    _check_batch(mbs, gas, tbs, dp_world_size)

    for key, value in zero.items():
        if stage == 0 and key != "stage":
            raise ConfigError(f"{ZERO}.{key} applies only to ZeRO stages 1-3, but stage is 0")
        if stage != 3 and _is_stage3_only(key):
            raise ConfigError(f"{ZERO}.{key} applies only to ZeRO stage 3, but stage is {stage}")
        if stage == 3 and key in STAGE12_ONLY_KEYS:
            raise ConfigError(f"{ZERO}.{key} applies only to ZeRO stages 1 and 2, but stage is 3")
        if key in _SIZE_KEYS:
            low = _SIZE_KEYS[key]
            if not (_is_int(value) and value >= low):
                what = "a positive integer" if low else "a non-negative integer"
                raise ConfigError(f"{ZERO}.{key} = {value!r}: expected {what} (elements)")
    if zero.get("compute_grad_norm") is False and stage not in (1, 2):
        raise ConfigError(f"{ZERO}.compute_grad_norm = false: supported only with ZeRO stage 1 or 2, "
                          f"but stage is {stage}")

    offloads = []
    for section in ("offload_optimizer", "offload_param"):
        off = zero.get(section)
        if off is None:
            continue
        if not isinstance(off, dict):
            raise ConfigError(f"{ZERO}.{section} = {off!r}: expected an object such as "
                              '{"device": "cpu"}')
        device = off.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{ZERO}.{section}.device = {device!r}: expected one of "
                              f"{', '.join(OFFLOAD_DEVICES)}")
        if device == "nvme" and not off.get("nvme_path"):
            raise ConfigError(f"{ZERO}.{section}.device = 'nvme' needs {ZERO}.{section}.nvme_path")
        if device != "none":
            offloads.append(section)
    if "offload_optimizer" in offloads:
        _check_offload_optimizer(ds_config)


def _check_batch(mbs: Any, gas: Any, tbs: Any, dp: int) -> None:
    if tbs is None or tbs == "auto":
        return
    known = {MBS: mbs, GAS: gas}
    known = {k: v for k, v in known.items() if v is not None and v != "auto"}
    if len(known) == 2:
        if tbs != mbs * gas * dp:
            raise ConfigError(f"{TBS} = {tbs!r}: expected {MBS} × {GAS} × dp_world_size = "
                              f"{mbs} × {gas} × {dp} = {mbs * gas * dp}")
    elif len(known) == 1:
        (key, value), = known.items()
        if tbs % (value * dp) != 0:
            other = GAS if key == MBS else MBS
            raise ConfigError(f"{TBS} = {tbs!r}: not divisible by {key} × dp_world_size = {value} × "
                              f"{dp}, so DeepSpeed cannot derive {other}")


def _check_offload_optimizer(ds_config: dict[str, Any]) -> None:
    optimizer = ds_config.get("optimizer")
    if optimizer is None or ds_config.get("zero_force_ds_cpu_optimizer") is False:
        return
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if not isinstance(kind, str) or kind.lower() not in OFFLOADABLE_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type = {kind!r}: {ZERO}.offload_optimizer needs an optimizer DeepSpeed can "
            f"run on the CPU ({', '.join(OFFLOADABLE_OPTIMIZERS)}), or set "
            f"\"zero_force_ds_cpu_optimizer\": false")


# --------------------------------------------------------------------------------------------
# Variables


def _variable_names(value: Any, path: str, out: dict[str, str]) -> None:
    """Collect placeholder name -> first path where it occurs."""
    if isinstance(value, str):
        for m in _PLACEHOLDER.finditer(value):
            name = m.group(2) or m.group(3)
            if name:
                out.setdefault(name, path)
    elif isinstance(value, dict):
        for k, v in value.items():
            _variable_names(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _variable_names(v, f"{path}[{i}]", out)


def _text(value: Any) -> str:
    value = _normalize(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _substitute(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, str):
        whole = _WHOLE_PLACEHOLDER.fullmatch(value)
        if whole:
            return copy.deepcopy(env[whole.group(1) or whole.group(2)])

        def repl(m: re.Match) -> str:
            if m.group(1):
                return "$"
            return _text(env[m.group(2) or m.group(3)])

        return _PLACEHOLDER.sub(repl, value)
    if isinstance(value, dict):
        return {k: _substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, env) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Generation


def is_list_valued(path: str) -> bool:
    """Whether the dotted key ``path`` is a DeepSpeed setting whose value is itself a list (e.g.
    ``optimizer.params.betas``), so a flat list there is the setting, not a list of candidates."""
    for rule in LIST_VALUED_KEYS:
        if rule.endswith(".*") and (path + ".").startswith(rule[:-1]):
            return True
        if path == rule:
            return True
    return False


def _dimensions(space: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], list]]) -> None:
    """Collect (path, candidates) for each list of candidates in the space."""
    if isinstance(space, dict):
        for k, v in space.items():
            _dimensions(v, path + (str(k),), out)
    elif isinstance(space, list):
        dotted = ".".join(path)
        if is_list_valued(dotted) and not (space and all(isinstance(v, list) for v in space)):
            return  # the setting itself, e.g. betas: [0.9, 0.999]
        if not space:
            raise ConfigError(f"tuning space key {dotted}: empty list, expected at least one candidate")
        out.append((path, space))


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: ``over`` replaces only the keys it names; dicts merge recursively."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _names_batch(space: dict[str, Any], base: dict[str, Any]) -> tuple[bool, bool]:
    """(space sets mbs or gas, space sets train_batch_size), counting templated base values."""
    templated: dict[str, str] = {}
    _variable_names(base, "", templated)
    templated_paths = {p.split("[")[0] for p in templated.values()}

    def named(key: str) -> bool:
        return key in space or key in templated_paths

    return named(MBS) or named(GAS), named(TBS)


def generate(
    base_config: dict[str, Any],
    space: dict[str, Any] | None,
    *,
    stage: int,
    dp_world_size: int,
    variables: dict[str, list[Any]] | None = None,
    fits: Callable[[dict[str, Any]], bool] | None = None,
) -> list[Candidate]:
    """Expand a tuning space over a base config into named, validated candidate configs.

    Each combination of the space's candidates (and of the variables) is deep-merged over the
    base config (the space overrides only the keys it names; the user's other settings, offload
    included, are kept), its ``zero_optimization.stage`` is set to ``stage``, the ``autotuning``
    section is removed, settings the stage does not read are pruned (:func:`prune`), and the
    result is deduplicated by :func:`canonical_json` (so pruned variants collapse; the first
    occurrence keeps its place). When the space sets the micro batch size or the gradient
    accumulation steps but not ``train_batch_size``, ``train_batch_size`` is removed and DeepSpeed
    derives it (mbs × gas × DP world size); a fixed global batch is kept when the space names it.

    Args:
        base_config: the user's ds_config (a template when it holds ``$VAR`` placeholders).
        space: the tuning space (see the module docstring); None or {} gives the base config.
        stage: ZeRO stage of every generated config (a space naming another stage is an error).
        dp_world_size: data-parallel world size, for validation.
        variables: variable name (with or without ``$``) -> list of candidates.
        fits: the memory model's predicate; a config for which it returns False is kept with
            ``fits=False``.

    Returns:
        Candidates in the documented deterministic order.

    Raises:
        ConfigError: bad space or variables, or a combination that fails :func:`validate`
            (a bad space is an error, never a silent drop).
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage = {stage!r}: expected 0, 1, 2 or 3")
    space = dict(space or {})
    base = {k: v for k, v in base_config.items() if k != "autotuning"}
    space.pop("autotuning", None)
    space_stage = space.get(ZERO, {}).get("stage", stage) if isinstance(space.get(ZERO), dict) else stage
    if space_stage != stage:
        raise ConfigError(f"tuning space {ZERO}.stage = {space_stage!r}, but generating stage {stage}")

    env = _check_variables(base, space, variables or {})
    dims: list[tuple[tuple[str, ...], list]] = []
    _dimensions(space, (), dims)
    dims += [(("$" + name,), values) for name, values in env.items()]
    dims.sort(key=lambda d: d[0])
    sets_batch, sets_tbs = _names_batch(space, base)

    configs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for combo in itertools.product(*(values for _, values in dims)):
        choice = copy.deepcopy(space)
        values = {}
        for (path, _), value in zip(dims, combo):
            if path[0].startswith("$"):
                values[path[0][1:]] = value
            else:
                _set(choice, path, value)
        cfg = _substitute(_merge(base, choice), values)
        if not isinstance(cfg.get(ZERO, {}), dict):
            raise ConfigError(f"{ZERO} = {cfg[ZERO]!r}: expected an object such as {{\"stage\": 2}}")
        cfg.setdefault(ZERO, {})["stage"] = stage
        if sets_batch and not sets_tbs:
            cfg.pop(TBS, None)
        cfg = _normalize(prune(cfg))
        key = canonical_json(cfg)
        if key not in seen:
            seen.add(key)
            configs.append(cfg)

    varying = _varying_keys(configs)
    candidates = []
    names: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        knobs = {k: v for k, v in _leaves(cfg) if k in varying}
        try:
            validate(cfg, dp_world_size)
        except ConfigError as e:
            raise ConfigError(f"tuning space gives an invalid config ({_describe(knobs)}): {e}") from None
        name = canonical_name(cfg, varying)
        if name in names:  # only two configs whose 32-bit hash prefixes collide
            raise RuntimeError(f"canonical name collision: {name}")
        names[name] = cfg
        candidates.append(Candidate(name, cfg, knobs, bool(fits(cfg)) if fits else True))
    return candidates


def _check_variables(base: dict[str, Any], space: dict[str, Any], variables: dict[str, Any]
                     ) -> dict[str, list[Any]]:
    env: dict[str, list[Any]] = {}
    for name, values in variables.items():
        bare = name[1:] if name.startswith("$") else name
        if bare in env:
            raise ConfigError(f"variable ${bare} is given twice (as {bare!r} and {'$' + bare!r})")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", bare):
            raise ConfigError(f"variable {name!r}: expected a name of letters, digits and _")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"variable ${bare} = {values!r}: expected a non-empty list of candidates")
        env[bare] = values
    used: dict[str, str] = {}
    _variable_names(base, "", used)
    _variable_names(space, "", used)
    for name, path in used.items():
        if name not in env:
            raise ConfigError(f"unresolved variable ${name} at {path}: give its candidates in "
                              f"variables (or write $$ for a literal $)")
    for name in env:
        if name not in used:
            raise ConfigError(f"variable ${name} is not used by any $-placeholder in the config or "
                              f"the tuning space")
    return env


def _varying_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Dotted leaf keys whose value (or presence) differs between configs, sorted."""
    per_config = [dict(_leaves(c)) for c in configs]
    keys = sorted(set().union(*per_config)) if per_config else []
    out = []
    for k in keys:
        texts = {canonical_json({"v": d[k]}) if k in d else None for d in per_config}
        if len(texts) > 1:
            out.append(k)
    return out


def _describe(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in knobs.items()) or "the base config"
