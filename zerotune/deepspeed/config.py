"""The user's DeepSpeed config and its ``autotuning`` section: parsing and validation.

The section keeps DeepSpeed's key names (``deepspeed/autotuning/constants.py``), so a config written for ``deepspeed
--autotuning tune`` works unchanged. Every error is a ``ConfigError`` (exit status 2) naming the file and the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from zerotune.core import user_files
from zerotune.core.errors import ConfigError

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
"""Script arguments that carry the ds_config path, as the ``deepspeed`` launcher's users pass it."""



class AutotuningConfig(BaseModel):
    """The ``autotuning`` section, with DeepSpeed's key names and defaults, except on purpose: ``overwrite`` defaults
    to False (a rerun resumes from the results on disk), unknown keys are errors and types are strict (JSON's own)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "fast": "yes" or "8" is an error, never coerced

    enabled: bool = True
    fast: bool = True
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    start_profile_step: int = Field(3, ge=1)
    end_profile_step: int = Field(5, ge=1)
    metric_path: str | None = None
    model_info_path: str | None = None
    model_info: dict[str, Any] | None = None
    results_dir: str = Field("autotuning_results", min_length=1)
    exps_dir: str = Field("autotuning_exps", min_length=1)
    overwrite: bool = False
    max_train_batch_size: int | None = Field(None, ge=1)
    min_train_batch_size: int = Field(1, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    mp_size: int = Field(1, ge=1)
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_num_trials: int = Field(50, ge=1)
    tuner_early_stopping: int = Field(5, ge=1)
    arg_mappings: dict[str, str] | None = None
    variables: dict[str, Any] | None = None  # zerotune's: $VAR candidates (zerotune.inputs.variables)
    max_steps_arg: str | None = None  # zerotune's: the script's steps flag, raised for experiments (deepspeed.args)
    allow_reduced_precision_states: bool = False  # zerotune's: the savers may try bf16 master weights and states

    @field_validator("results_dir", "exps_dir")
    @classmethod
    def _no_nul(cls, path: str) -> str:
        if "\0" in path:
            raise ValueError("a path cannot hold a NUL character")
        return path

    @field_validator("max_steps_arg")
    @classmethod
    def _a_flag(cls, flag: str | None) -> str | None:
        if flag is not None and (not flag.startswith("-") or flag.strip("-") == "" or "=" in flag
                                 or any(c.isspace() for c in flag) or flag in CONFIG_FLAGS):
            raise ValueError("expected the script's flag for its length in steps, such as '--max_steps'")
        return flag

    @model_validator(mode="after")
    def _check_ranges(self) -> "AutotuningConfig":
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"end_profile_step ({self.end_profile_step}) must be >= start_profile_step "
                             f"({self.start_profile_step})")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError(f"max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu}) must be "
                             f">= min_train_micro_batch_size_per_gpu ({self.min_train_micro_batch_size_per_gpu})")
        return self


def parse_autotuning(section: Any, source: str = "ds_config") -> AutotuningConfig:
    """Validate an ``autotuning`` section.

    Raises:
        ConfigError: naming ``source``, each unknown key or bad value, and what was expected.
    """
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: 'autotuning' must be an object, got {type(section).__name__}")
    try:
        return AutotuningConfig(**section)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                known = ", ".join(sorted(AutotuningConfig.model_fields))
                problems.append(f"unknown key 'autotuning.{key}' (known keys: {known})")
            elif key:
                problems.append(f"'autotuning.{key}' = {err.get('input')!r}: {err['msg']}")
            else:
                problems.append(f"'autotuning': {err['msg']}")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


CONFIG_RULE = "a DeepSpeed config is UTF-8 JSON (non-ASCII text may be written as \\uXXXX)"
"""What a ds_config file is, as the messages about one say it."""


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """Read a ds_config JSON file, bounded as every file the user names (`zerotune.core.user_files`).

    Raises:
        ConfigError: naming the file: missing, unreadable or not a regular file, larger than 4 MiB, not UTF-8 (with
            the first bad byte's offset), invalid JSON (with line and column), nested over 64 levels, or not an object.
    """
    return user_files.load_object(path, str(path), CONFIG_RULE)


def config_args(script_args: Sequence[str]) -> list[tuple[int, str, str]]:
    """Every ds_config path in the script's arguments as ``(index of the argument holding it, flag, path)``, from
    ``--deepspeed_config PATH``, ``--deepspeed PATH`` or ``--flag=PATH`` (``--deepspeed`` alone is DeepSpeed's switch).

    Raises:
        ConfigError: a path is the empty string (an unset shell variable).
    """
    found: list[tuple[int, str, str]] = []
    for i, arg in enumerate(script_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(script_args) and not script_args[i + 1].startswith("-"):
                index, path = i + 1, script_args[i + 1]
            elif arg.startswith(flag + "="):
                index, path = i, arg.split("=", 1)[1]
            else:
                continue
            if not path:
                raise ConfigError(f"{flag} '': expected the path of a DeepSpeed config, not the empty string")
            found.append((index, flag, path))
    return found


def find_config_arg(script_args: list[str]) -> tuple[int, str]:
    """``(index of the argument holding it, path)`` of the one ds_config path in the script's arguments (`config_args`).

    Raises:
        ConfigError: no argument carries a path, the path is empty, or two carry one (which the script reads is its
            parser's choice, not zerotune's).
    """
    found = config_args(script_args)
    if len(found) > 1:
        raise ConfigError("the training script's arguments carry a DeepSpeed config twice ("
                          + " and ".join(f"{flag} {path!r}" for _, flag, path in found)
                          + "): give it once, so that the config zerotune tunes is the one the script reads")
    if found:
        return found[0][0], found[0][2]
    raise ConfigError("the training script's arguments carry no DeepSpeed config: pass "
                      "'--deepspeed_config ds_config.json' (or '--deepspeed ds_config.json') after the script")


def replace_config_arg(script_args: list[str], new_path: str) -> list[str]:
    """Return a copy of ``script_args`` with the ds_config path replaced by ``new_path``."""
    index, _ = find_config_arg(script_args)
    args = list(script_args)
    args[index] = (args[index].split("=", 1)[0] + "=" + new_path) if "=" in args[index] and args[index].startswith("--") \
        else new_path
    return args


def stage_candidates(ds_config: dict[str, Any], source: str = "ds_config") -> list[int]:
    """ZeRO stages to explore, sorted and unique: ``zero_optimization.stage``, an int, a list or ``"all"`` (default).

    Raises:
        ConfigError: a stage outside 0-3, a value of another type, or an empty list.
    """
    zero = ds_config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: 'zero_optimization' must be an object")
    value = zero.get("stage", "all")
    values = [0, 1, 2, 3] if value == "all" else value if isinstance(value, list) else [value]
    stages = set()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 3:
            raise ConfigError(f"{source}: 'zero_optimization.stage' = {value!r}: expected 0, 1, 2, 3, "
                              f"a list of them, or \"all\"")
        stages.add(v)
    if not stages:
        raise ConfigError(f"{source}: 'zero_optimization.stage' is an empty list")
    return sorted(stages)


def precision(ds_config: dict[str, Any]) -> str:
    """``"fp16"``, ``"bf16"`` or ``"fp32"``, from the ``fp16``/``bf16`` sections (``bfloat16`` alias)."""
    for key, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled", False):
            return name
    return "fp32"
