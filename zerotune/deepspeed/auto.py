"""The ds_config's ``"auto"`` values, resolved as the Hugging Face ``Trainer`` resolves them, to name, validate and
estimate each experiment.

``"auto"`` mbs is the experiment's, passed through ``autotuning.arg_mappings`` (required: `check_trainer_batch`); gas
is the script's flag's value, else 1, and fp16/bf16 its precision flags (`script_autos`); ``train_batch_size`` is
mbs x gas x DP world size, left out of the launched config with a mapped mbs (DeepSpeed derives it; the Trainer would
take accelerate's world size, 1 on CPU); the bucket sizes come from the hidden size the profile run records
(`hidden_size_autos`). Everything else (lr, scheduler, clipping...) stays ``"auto"``, in the optimal config too.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.args import flag_value
from zerotune.deepspeed.keys import CHECKPOINTING, GAS, MBS, ZERO
from zerotune.probe.sitecustomize import ENGINE_RECORD

__all__ = ["AUTO", "ENGINE_RECORD", "MODEL_AUTO_KEYS", "TRAINER_CHECKPOINTING_FLAG", "TRAINER_FLAGS", "auto_paths",
           "check_trainer_batch", "checkpointing_flag", "hidden_size_autos",
           "read_engine_record", "resolve", "script_autos"]

AUTO = "auto"

TRAINER_FLAGS = {MBS: "--per_device_train_batch_size", GAS: "--gradient_accumulation_steps"}
"""The Trainer's own flags for the batch keys (``TrainingArguments``), used where a key is not mapped."""

PRECISION_FLAGS = {"fp16.enabled": ("--fp16", "--fp16_full_eval"), "bf16.enabled": ("--bf16", "--bf16_full_eval")}
"""``TrainingArguments`` flags from which the Trainer fills each precision ``"auto"`` (any of them on)."""

MODEL_AUTO_KEYS = (f"{ZERO}.reduce_bucket_size", f"{ZERO}.stage3_prefetch_bucket_size",
                   f"{ZERO}.stage3_param_persistence_threshold")
"""The ``"auto"`` keys the Trainer fills from the model's hidden size."""

_TRUE, _FALSE = ("", "yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # transformers' string_to_bool


def auto_paths(config: Any, path: str = "") -> list[str]:
    """Dotted paths whose value is ``"auto"`` (or a list of candidates holding it); the
    ``autotuning`` section aside."""
    if isinstance(config, dict):
        return [p for key, v in config.items() if path or key != "autotuning"
                for p in auto_paths(v, f"{path}.{key}" if path else key)]
    if config == AUTO or (isinstance(config, list) and AUTO in config):
        return [path]
    return []


def script_autos(config: Mapping[str, Any], script_args: Sequence[str], mappings: Mapping[str, str],
                 source: str = "ds_config") -> dict[str, Any]:
    """The ``"auto"`` gas and precision values the script's arguments set: dotted path -> value.

    Raises:
        ConfigError: a flag's value the Trainer would not accept (naming flag and value).
    """
    autos = set(auto_paths(config))
    values: dict[str, Any] = {}
    if GAS in autos:
        flag = mappings.get(GAS, TRAINER_FLAGS[GAS])
        text = flag_value(script_args, flag)
        if text is None:
            values[GAS] = 1
        elif text.isdigit() and int(text) >= 1:
            values[GAS] = int(text)
        else:
            raise ConfigError(f"{source}: '{GAS}' is \"auto\", filled from the script's {flag} {text!r}: "
                              f"expected a positive integer")
    for path, flags in PRECISION_FLAGS.items():
        if path in autos:
            flags = flags + ((mappings[path],) if path in mappings else ())
            values[path] = any(_flag_on(script_args, flag, source) for flag in flags)
    return values


def _flag_on(script_args: Sequence[str], flag: str, source: str) -> bool:
    text = flag_value(script_args, flag)
    if text is None:
        return False
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ConfigError(f"{source}: the script's {flag} {text!r}: expected true or false")


def hidden_size_autos(hidden_size: int) -> dict[str, int]:
    """The Trainer's values for `MODEL_AUTO_KEYS` from the model's hidden size h (``trainer_config_finalize``: h*h,
    int(0.9*h*h), 10*h); the profile run records h (`ENGINE_RECORD`) and itself runs with zerotune's small buckets."""
    h = int(hidden_size)
    return dict(zip(MODEL_AUTO_KEYS, (h * h, int(0.9 * h * h), 10 * h)))


def resolve(config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` where each dotted path of ``values`` that holds ``"auto"`` (or a list of
    candidates with ``"auto"`` in it) takes the value; other values are untouched."""
    out = copy.deepcopy(dict(config))
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        current = node[leaf]
        if current == AUTO:
            node[leaf] = copy.deepcopy(value)
        elif isinstance(current, list):
            candidates: list[Any] = []
            for c in (value if c == AUTO else c for c in current):
                if c not in candidates:
                    candidates.append(copy.deepcopy(c))
            node[leaf] = candidates
    return out


def read_engine_record(exp_dir: Path) -> dict[str, Any] | None:
    """The probe's record of the engine in ``exp_dir`` (rank 0, first forward), None when unreadable: ``ds_config``
    (the Trainer's ``"auto"`` filled in), ``hidden_size`` and ``max_positions`` (the model's, as the Trainer reads them;
    None when it has none), and the three batch keys."""
    try:
        data = json.loads((Path(exp_dir) / ENGINE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_trainer_batch(config: Mapping[str, Any], mappings: Mapping[str, str], gas_varies: bool,
                        source: str = "ds_config") -> None:
    """Check that a Trainer config (one holding ``"auto"`` values) maps mbs, and gas where ``gas_varies`` (the batch
    semantics try more than one gas), in ``arg_mappings``: the Trainer checks both against its own arguments.

    Raises:
        ConfigError: naming the key and the flag to map.
    """
    if not auto_paths(config):
        return
    needed = [MBS] + ([GAS] if gas_varies else [])
    for key in needed:
        if key not in mappings:
            raise ConfigError(f"{source}: a Hugging Face Trainer config (it holds \"auto\" values) needs "
                              f"'autotuning.arg_mappings' for '{key}', e.g. {{\"{key}\": \"{TRAINER_FLAGS[key]}\"}}: "
                              f"the Trainer checks each experiment's {key} against its {TRAINER_FLAGS[key]} and "
                              f"raises on a mismatch")


TRAINER_CHECKPOINTING_FLAG = "--gradient_checkpointing"
"""The Hugging Face ``Trainer``'s switch for activation checkpointing (``TrainingArguments.gradient_checkpointing``;
``--gradient_checkpointing True`` turns it on)."""


def checkpointing_flag(user: dict[str, Any], script_args: Sequence[str], mappings: dict[str, str]) -> bool:
    """Whether the job may tune activation checkpointing (`zerotune.deepspeed.keys.CHECKPOINTING`): only where the
    user's config does not set the key, and either ``arg_mappings`` maps it to a flag or a Trainer config's arguments
    do not set `TRAINER_CHECKPOINTING_FLAG` (the caller then adds that mapping); otherwise the user's choice stands."""
    if CHECKPOINTING in user:
        return False
    if CHECKPOINTING in mappings:
        return True
    return bool(auto_paths(user)) and flag_value(script_args, TRAINER_CHECKPOINTING_FLAG) is None
