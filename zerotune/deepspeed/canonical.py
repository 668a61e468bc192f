"""Identity and names of DeepSpeed configs: canonical text, content hash, canonical name (D2).

Two configs are the same experiment when DeepSpeed reads them the same way: `config_hash` hashes the `canonical_json`
of `without_defaults`, so spelling a default changes nothing. `canonical_name` is a readable name in the style of
DeepSpeed's own autotuner (``z1_gas1_tmbspg8``) plus an acronym and value per named knob not at its default.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Iterable, Iterator

from zerotune.deepspeed.keys import GAS, MBS, TBS, ZERO, ZERO_DEFAULTS

__all__ = [
    "ACRONYMS",
    "canonical_json",
    "canonical_name",
    "config_hash",
    "leaves",
    "normalize",
    "without_defaults",
]

# Canonical-name acronyms, in name order. Collision-free: unique, prefix-free, none starts with "z" (the stage) or
# "h" (the hash) or ends with a digit (tests check this). Only a value of an acronym's kind is written losslessly.
# "tmbspg" is the mbs in DeepSpeed's autotuner's experiment names (autotuning/autotuner.py).
ACRONYMS: dict[str, tuple[str, str]] = {
    MBS: ("tmbspg", "int"),
    GAS: ("gas", "int"),
    TBS: ("tbs", "int"),
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
    "zero_optimization.offload_optimizer.ratio": ("ofr", "float"),
    "zero_optimization.zero_hpz_partition_size": ("secp", "int"),
    "zero_optimization.zero_quantized_weights": ("qw", "bool"),
    "zero_optimization.zero_quantized_gradients": ("qg", "bool"),
    "zero_optimization.offload_param.device": ("op", "str"),
    "zero_optimization.offload_param.pin_memory": ("pinp", "bool"),
    "fp16.enabled": ("fp", "bool"),
    "bf16.enabled": ("bf", "bool"),
    "bf16.bf16_master_weights_and_grads": ("mwbf", "bool"),
    "bf16.bf16_optimizer_states": ("osbf", "bool"),
    "activation_checkpointing.partition_activations": ("pact", "bool"),
    "activation_checkpointing.cpu_checkpointing": ("cpuck", "bool"),
    "gradient_checkpointing": ("gck", "bool"),
    "tensor_parallel.autotp_size": ("tp", "int"),
    "sequence_parallel_size": ("sp", "int"),
}
_NAME_HASH_CHARS = 8
_MAX_VALUE_TEXT = 24  # characters of a lossy value's text; the hash identifies the value
_LOSSLESS_STR = re.compile(r"[a-z][a-z0-9]*")
_MISSING = object()


def normalize(value: Any) -> Any:
    """Numbers in canonical form: a float with an integral value becomes an int (5e8 == 500000000); dicts and lists
    are copied with their numbers normalised (dict keys become str)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return int(value)
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {str(k): normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    return value


def canonical_json(ds_config: dict[str, Any]) -> str:
    """The config as JSON with sorted keys, no whitespace and normalised numbers; a setting spelled at its default
    is kept (identity ignores defaults: `config_hash`)."""
    return json.dumps(normalize(ds_config), sort_keys=True, separators=(",", ":"))


def without_defaults(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The config without the zero_optimization settings equal to DeepSpeed's default at its stage
    (`zerotune.deepspeed.keys.ZERO_DEFAULTS`; compared after `normalize`, a bool equal only to a bool). A missing stage
    counts as 0; a stage not 0..3, or a zero_optimization not a dict, leaves the config unchanged. Only the top level
    and zero_optimization are new dicts: other nested values are shared with ``ds_config`` (do not mutate them)."""
    zero = ds_config.get(ZERO)
    if not isinstance(zero, dict):
        return dict(ds_config)
    stage = normalize(zero.get("stage", 0))
    defaults = ZERO_DEFAULTS.get(stage) if type(stage) is int else None
    if defaults is None:
        return dict(ds_config)

    def is_default(key: str, value: Any) -> bool:
        value = normalize(value)
        return key in defaults and type(value) is type(defaults[key]) and value == defaults[key]

    return {**ds_config, ZERO: {k: v for k, v in zero.items() if not is_default(k, v)}}


def config_hash(ds_config: dict[str, Any]) -> str:
    """The config's identity: SHA-256 (hex, 64 characters) of the `canonical_json` of `without_defaults`."""
    return hashlib.sha256(canonical_json(without_defaults(ds_config)).encode()).hexdigest()


def leaves(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path as a tuple, value) for each leaf of a nested dict; lists and empty dicts are leaves."""
    for k, v in d.items():
        path = prefix + (str(k),)
        if isinstance(v, dict) and v:
            yield from leaves(v, path)
        else:
            yield path, v


def _lookup(d: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return _MISSING
        d = d[k]
    return d


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
    """Shortest text that round-trips, exponent without "+" or leading zeros (1e-5, 1e20, inf)."""
    s = repr(x)
    return s.replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _format_value(value: Any, kind: str) -> tuple[str, bool]:
    """(text, lossless) for a value named by an acronym of ``kind`` ("bool", "int", "str"): text of ``[A-Za-z0-9.-]``
    only, lossless when it identifies the value among values of ``kind``; any other value is written approximately
    (at most 24 characters) and the name then carries the hash."""
    value = normalize(value)
    if isinstance(value, bool):
        return ("1" if value else "0"), kind == "bool"
    if isinstance(value, int):
        text = _format_int(value)
        if len(text) > _MAX_VALUE_TEXT:  # e.g. 1e142 read as an int: its digits, cut; the hash identifies it
            return text[:_MAX_VALUE_TEXT], False
        return text, kind == "int"
    if isinstance(value, float):
        return _format_float(value), False
    if isinstance(value, str):
        if kind == "str" and _LOSSLESS_STR.fullmatch(value):
            return value, True
        return re.sub(r"[^A-Za-z0-9]+", "-", value)[:_MAX_VALUE_TEXT] or "-", False
    if isinstance(value, list):
        return "-".join(_format_value(v, "")[0] for v in value)[:_MAX_VALUE_TEXT] or "-", False
    if value is None:
        return "null", False
    return "-", False


def canonical_name(ds_config: dict[str, Any], extra_keys: Iterable[str] = ()) -> str:
    """A readable name for a config, unique among the configs of one tuning job, of ``[A-Za-z0-9._-]`` only.

    ``z{stage}_gas{gas}_tmbspg{mbs}`` (a missing stage is 0, a missing gas 1), then ``_{acronym}{value}`` for each key
    of `ACRONYMS` not at DeepSpeed's default (`without_defaults`), in its order: ``z2_gas2_tmbspg8_oc1_rbs5e7``.
    Numbers are compact (``5e7``, powers of two as is), booleans ``1``/``0``; ``train_batch_size`` is named only where
    mbs or gas is missing. ``_h`` and the first 8 hex digits of `config_hash` follow where the readable part does not
    identify the config: a lossy value (a float, a string other than lowercase letters and digits, a value of the
    wrong kind), a missing mbs (``tmbspg-``) or derived gas (``gas-``), or a key of ``extra_keys`` (dotted keys the job
    varies that have no acronym, ``optimizer.params.lr``), or one under it, in the config. Other settings (the user's
    optimizer...) are taken to be the same for the whole job.
    """
    cfg = without_defaults(ds_config)
    zero = cfg.get(ZERO, {})
    stage = normalize(zero.get("stage", 0)) if isinstance(zero, dict) else _MISSING
    exact = type(stage) is int and 0 <= stage <= 3
    parts = [f"z{stage}" if exact else "z-"]

    mbs, gas = cfg.get(MBS, _MISSING), cfg.get(GAS, _MISSING)
    if gas is _MISSING and TBS not in cfg:
        gas = 1
    for key, value in ((GAS, gas), (MBS, mbs)):
        acronym, kind = ACRONYMS[key]
        text, lossless = ("-", False) if value is _MISSING else _format_value(value, kind)
        parts.append(acronym + text)
        exact = exact and lossless

    for key, (acronym, kind) in ACRONYMS.items():
        if key in (MBS, GAS) or (key == TBS and MBS in cfg and GAS in cfg):
            continue
        value = _lookup(cfg, key)
        if value is not _MISSING:
            text, lossless = _format_value(value, kind)
            parts.append(acronym + text)
            exact = exact and lossless

    extra = tuple(extra_keys)
    present = (".".join(path) for path, _ in leaves(cfg))
    if not exact or any(p == k or p.startswith(k + ".") for p in present for k in extra):
        parts.append("h" + config_hash(ds_config)[:_NAME_HASH_CHARS])
    return "_".join(parts)
