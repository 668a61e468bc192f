"""``autotuning.arg_mappings``: each experiment's ds_config values written into the script's own flags (D323).

Every launch (profile run, experiments, ``cmd_optimal.txt``, ``zerotune run``) writes each mapped key's value into its
flag (`apply_arg_mappings`), so a Hugging Face ``Trainer`` script gets the mbs it runs at, and any mapped key can be a
tuning dimension. ``autotuning.max_steps_arg`` names the script's steps flag, raised in each experiment past the last
step DeepSpeed measures (`raise_steps`); the answer's command keeps the user's value.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.config import CONFIG_FLAGS
from zerotune.deepspeed.keys import CHECKPOINTING

__all__ = ["STEP_FLAGS", "apply_arg_mappings", "arg_text", "check_mapped_keys", "flag_value", "mapped_value",
           "parse_arg_mappings", "raise_steps", "set_flag", "step_flag"]

_MISSING = object()


def parse_arg_mappings(mappings: Mapping[str, str] | None, source: str = "ds_config") -> dict[str, str]:
    """Check ``autotuning.arg_mappings`` (ds_config key -> script flag); return it as a new dict (empty for None).

    Raises:
        ConfigError: naming ``source`` and the entry: an empty or ``autotuning.*`` key; a flag not starting with ``-``,
            holding whitespace or ``=``, the ds_config's own flag (``--deepspeed``, ``--deepspeed_config``), or mapped
            from two keys.
    """
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key, flag in (mappings or {}).items():
        where = f"{source}: 'autotuning.arg_mappings.{key}' = {flag!r}"
        if not key or key.split(".")[0] == "autotuning":
            raise ConfigError(f"{where}: expected a ds_config key such as 'train_micro_batch_size_per_gpu'")
        if not flag.startswith("-") or flag.strip("-") == "" or any(c.isspace() for c in flag) or "=" in flag:
            raise ConfigError(f"{where}: expected the script's flag, such as '--per_device_train_batch_size'")
        if flag in CONFIG_FLAGS:
            raise ConfigError(f"{where}: {flag} carries the ds_config path, which zerotune sets for each experiment")
        if flag in seen:
            raise ConfigError(f"{where}: {flag} is mapped from '{seen[flag]}' too")
        seen[flag] = key
        out[key] = flag
    return out


def mapped_value(ds_config: Mapping[str, Any], key: str) -> Any:
    """The value of ``key`` in ``ds_config``, None when absent: ``key`` is a dotted path, or a name looked up at the top
    level, then depth first in the sections (DeepSpeed's ``get_val_by_key``); ``autotuning`` is never read."""
    value = _lookup(ds_config, key)
    return None if value is _MISSING else value


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    if "." in key:
        node: Any = config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return _MISSING
            node = node[part]
        return node
    if key in config:
        return config[key]
    for name, section in config.items():
        if name != "autotuning" and isinstance(section, Mapping):
            found = _lookup(section, key)
            if found is not _MISSING:
                return found
    return _MISSING


def arg_text(value: Any) -> str:
    """A config value as a script argument: integral floats as ints (``5e8`` -> ``500000000``),
    lists and objects as JSON, everything else as ``str`` (``True``, ``4``, ``3e-05``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _takes_value(args: Sequence[str], i: int) -> bool:
    """Whether ``args[i]`` (a bare flag) is followed by its value rather than by another flag."""
    return i + 1 < len(args) and not args[i + 1].startswith("--")


def apply_arg_mappings(script_args: Sequence[str], mappings: Mapping[str, str],
                       ds_config: Mapping[str, Any]) -> list[str]:
    """The script's arguments (a new list) with each mapped key's value from ``ds_config`` set by `set_flag` (every
    occurrence: argparse takes the last); a key absent or ``"auto"`` leaves them as they are (the Trainer fills it)."""
    args = list(script_args)
    for key, flag in mappings.items():
        value = mapped_value(ds_config, key)
        if value is None or value == "auto":
            continue
        args = set_flag(args, flag, arg_text(value))
    return args


def set_flag(script_args: Sequence[str], flag: str, text: str) -> list[str]:
    """The script's arguments with every occurrence of ``flag`` given ``text`` (``--flag v`` and ``--flag=v``; a flag
    without a value gets it after), or ``flag text`` appended where it is absent."""
    args = list(script_args)
    out, found, i = [], False, 0
    while i < len(args):
        arg = args[i]
        if arg == flag:
            found = True
            out += [flag, text]
            i += 2 if _takes_value(args, i) else 1
            continue
        if arg.startswith(flag + "="):
            found = True
            arg = f"{flag}={text}"
        out.append(arg)
        i += 1
    return out if found else out + [flag, text]


STEP_FLAGS = ("--max_steps", "--max-steps", "--max_train_steps", "--num_train_steps", "--train_steps",
              "--total_steps", "--num_steps", "--steps", "--train_iters", "--train-iters")
"""Flags that set a training script's length in steps (Hugging Face's Trainer, Accelerate's examples, Megatron,
common loops), by which the summary names the one the user's command holds."""


def step_flag(script_args: Sequence[str], max_steps_arg: str | None = None) -> str | None:
    """The script's flag for its length in steps: ``max_steps_arg`` (``autotuning.max_steps_arg``) where set, else the
    first of `STEP_FLAGS` the arguments hold; None when neither names one."""
    if max_steps_arg:
        return max_steps_arg
    return next((f for f in STEP_FLAGS if flag_value(script_args, f) is not None), None)


def raise_steps(script_args: Sequence[str], flag: str, ds_config: Mapping[str, Any]) -> list[str]:
    """An experiment's arguments with ``flag`` raised to ``(end_profile_step + 2) * gas`` (enough whether the script
    counts optimizer or micro steps) so it runs past the last step DeepSpeed measures, unless it already asks for as
    many; a config without ``autotuning.end_profile_step`` (the answer's) leaves the user's arguments."""
    end = (ds_config.get("autotuning") or {}).get("end_profile_step")
    if not isinstance(end, int) or isinstance(end, bool):
        return list(script_args)
    gas = ds_config.get("gradient_accumulation_steps", 1)
    steps = (end + 2) * (gas if isinstance(gas, int) and not isinstance(gas, bool) and gas > 0 else 1)
    current = flag_value(script_args, flag)
    if current is not None and current.strip().isdigit() and int(current) >= steps:
        return list(script_args)
    return set_flag(script_args, flag, str(steps))


def flag_value(script_args: Sequence[str], flag: str) -> str | None:
    """The value the script's parser reads for ``flag`` (its last occurrence, ``--flag v`` or
    ``--flag=v``): ``""`` for a flag given without a value, None when the flag is absent."""
    value = None
    for i, arg in enumerate(script_args):
        if arg == flag:
            value = script_args[i + 1] if _takes_value(script_args, i) else ""
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


ZEROTUNE_SET = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "zero_optimization.stage", "stage", CHECKPOINTING)
"""Keys zerotune sets in experiments' configs whatever the user's config says (the batch and the stage in every
one; `zerotune.deepspeed.keys.CHECKPOINTING` in those of the savers phase)."""


def check_mapped_keys(mappings: Mapping[str, str], ds_config: Mapping[str, Any], source: str = "ds_config") -> None:
    """Check that every mapped key is set in ``ds_config`` or by zerotune (`ZEROTUNE_SET`).

    Raises:
        ConfigError: naming the mapping whose key no experiment would hold (it would never reach the script).
    """
    for key, flag in mappings.items():
        if key not in ZEROTUNE_SET and _lookup(ds_config, key) is _MISSING:
            raise ConfigError(f"{source}: 'autotuning.arg_mappings.{key}' = {flag!r}: the config does not set "
                              f"'{key}', so no experiment would pass {flag}; set it (a value or a list of candidates)")
