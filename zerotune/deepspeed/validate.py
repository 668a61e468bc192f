"""Checks on a DeepSpeed config before anything runs: `prune` drops the zero_optimization settings its stage does not
read, `validate` refuses what DeepSpeed would refuse (or silently misread) with a `zerotune.core.errors.ConfigError`
naming the key, the value and what was expected."""
from __future__ import annotations

import copy
import math
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import (
    GAS,
    MBS,
    OFFLOAD_DEVICES,
    OFFLOADABLE_OPTIMIZERS,
    SIZE_KEYS,
    STAGE12_ONLY_KEYS,
    TBS,
    ZERO,
    is_stage3_only,
    model_fields,
)

__all__ = ["OBJECT_SECTIONS", "check_sections", "prune", "validate"]

OBJECT_SECTIONS = ("optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "activation_checkpointing")
"""Sections DeepSpeed (and zerotune's memory model, for ``optimizer``) reads the keys of: each is an object."""


def check_sections(ds_config: dict[str, Any], source: str, candidates: bool = True) -> None:
    """Check that each of `OBJECT_SECTIONS` the config holds is an object, or where ``candidates`` a list of objects;
    ``null`` counts as absent.

    Raises:
        ConfigError: naming ``source``, the section, its value and an example object.
    """
    for key in OBJECT_SECTIONS:
        value = ds_config.get(key)
        ok = value is None or isinstance(value, dict) or (
            candidates and isinstance(value, list) and all(isinstance(v, dict) for v in value))
        if not ok:
            example = '{"type": "AdamW"}' if key in ("optimizer", "scheduler") else '{"enabled": true}'
            raise ConfigError(f"{source}: '{key}' = {value!r}: expected an object such as {example}"
                              + (", or a list of candidate objects" if candidates else ""))


def prune(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config without the zero_optimization settings its stage does not read: stage 0 keeps only
    ``stage``, stages 1-2 lose the stage-3-only keys (``stage3_*``, `zerotune.deepspeed.keys.STAGE3_ONLY_KEYS`), stage 3
    loses `zerotune.deepspeed.keys.STAGE12_ONLY_KEYS`; keys zerotune does not know are kept."""
    cfg = copy.deepcopy(ds_config)
    zero = cfg.get(ZERO)
    if not isinstance(zero, dict):
        return cfg
    stage = zero.get("stage", 0)
    if stage == 0:
        cfg[ZERO] = {"stage": 0} if "stage" in zero else {}
    elif stage in (1, 2):
        cfg[ZERO] = {k: v for k, v in zero.items() if not is_stage3_only(k)}
    elif stage == 3:
        cfg[ZERO] = {k: v for k, v in zero.items() if k not in STAGE12_ONLY_KEYS}
    return cfg


def _check_removed(ds_config: dict[str, Any]) -> None:
    """Raise DeepSpeed's own refusal of the settings it has removed (``runtime/config.py``,
    ``_reject_removed_config_keys``: MiCS, LoCo-ZeRO++...) as a `ConfigError` (D320); none where DeepSpeed lacks it."""
    try:
        from deepspeed.runtime.config import _reject_removed_config_keys
    except Exception:  # noqa: BLE001 - not installed, or a DeepSpeed without the check
        return
    try:
        _reject_removed_config_keys(ds_config)
    except Exception as e:  # noqa: BLE001 - DeepSpeedConfigError
        raise ConfigError(f"DeepSpeed refuses the config: {e}") from None


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
    """Check a config (not modified) before anything runs; ``dp_world_size`` is ranks / model-parallel size.

    Raises:
        ConfigError: naming key, value and expectation where ``zero_optimization`` is not a dict or its ``stage`` not
            0-3; mbs is not a positive int, gas or ``train_batch_size`` neither that nor ``"auto"``;
            ``train_batch_size`` is not mbs × gas × dp_world_size (with one of mbs/gas missing, not divisible by the
            product of the others); a bucket size is not a positive int, a stage-3 size or threshold not a
            non-negative one; a key is set for a stage that does not read it (`prune`) or was removed by DeepSpeed;
            ``compute_grad_norm`` is false outside stages 1-2; an offload device is not none/cpu/nvme, nvme lacks
            ``nvme_path``, or optimizer offload has an optimizer DeepSpeed cannot run on the CPU
            (`zerotune.deepspeed.keys.OFFLOADABLE_OPTIMIZERS`), unless the optimizer is the client's (no ``optimizer``
            section) or ``zero_force_ds_cpu_optimizer`` is false.
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
    if set(zero) - (model_fields(ZERO) or set(zero)):
        _check_removed(ds_config)

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
        if stage != 3 and is_stage3_only(key):
            raise ConfigError(f"{ZERO}.{key} applies only to ZeRO stage 3, but stage is {stage}")
        if stage == 3 and key in STAGE12_ONLY_KEYS:
            raise ConfigError(f"{ZERO}.{key} applies only to ZeRO stages 1 and 2, but stage is 3")
        if key in SIZE_KEYS:
            low = SIZE_KEYS[key]
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
