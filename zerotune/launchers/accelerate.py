"""``accelerate launch [options] SCRIPT ARGS...`` with a DeepSpeed configuration, read by Accelerate's own parser and
config loader (the YAML merged under the command line's options, as ``accelerate launch`` merges them).

The DeepSpeed config is the YAML's or the command's ``deepspeed_config_file``, else
``$ACCELERATE_DEEPSPEED_CONFIG_FILE``, else the inline fields as Accelerate's ``DeepSpeedPlugin`` builds them. Each
experiment runs on one node with torchrun's ranks and the variables ``prepare_deepspeed_cmd_env`` sets, its config
as ``deepspeed_config_file`` (inline fields inside it: Accelerate refuses both at once), its Ulysses degree as the
variables of the YAML's ``parallelism_config`` (`AccelerateLauncher.rank_env`). The answer is the user's line with
``--config_file accelerate_config_optimal.yaml`` (`answer_yaml`).
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

from zerotune.core import user_files
from zerotune.core.errors import ConfigError
from zerotune.deepspeed.config import load_ds_config
from zerotune.deepspeed.launcher import shell_word
from zerotune.launchers.base import Answer, Launcher
from zerotune.launchers.contract import TORCHRUN

__all__ = ["ANSWER_YAML", "CONFIG_FILE_ENV", "AccelerateLauncher", "read_accelerate"]

CONFIG_FILE_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ANSWER_YAML = "accelerate_config_optimal.yaml"
"""The answer's Accelerate config, beside ``ds_config_optimal.json``."""
INLINE_FIELDS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                 "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
                 "zero3_save_16bit_model")
"""Accelerate's DeepSpeed fields that a ``deepspeed_config_file`` replaces (``DeepSpeedPlugin._deepspeed_config_checks``
refuses them beside one): in the YAML's ``deepspeed_config`` and as ``accelerate launch`` options."""
_YAML_RULE = "expected an Accelerate config (accelerate config's YAML, with distributed_type: DEEPSPEED)"
USE_PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"
"""The variable by which Accelerate's ``Accelerator`` builds its ``ParallelismConfig`` from ``PARALLELISM_CONFIG_*``."""
SP_KEY = "sequence_parallel_size"


@dataclass(frozen=True)
class AccelerateLauncher(Launcher):
    """``accelerate launch``: torchrun's ranks, with Accelerate's DeepSpeed variables.

    Attributes:
        config_file, yaml: the Accelerate config the command names or Accelerate's default (None: none), and its
            content, for the answer's YAML.
        env: ``(name, value)`` of the variables Accelerate gives every rank, but the config file's.
        config_path, inline: the ds_config file the launch names (None: inline fields), else the ds_config Accelerate
            builds from those fields.
        sp_size: the Ulysses degree of the launch's ``parallelism_config`` (None: the launch has none).
        sp_env: ``(degree, variables)``: for each degree above 1 that divides the ranks, the ``PARALLELISM_CONFIG_*``
            variables of a launch whose ``parallelism_config`` sets it (`_ulysses_env`).
    """

    name: ClassVar[str] = "accelerate"
    contract: ClassVar[str] = TORCHRUN
    config_file: str | None = None
    yaml: dict[str, Any] = field(default_factory=dict, hash=False)
    env: tuple[tuple[str, str], ...] = ()
    config_path: str | None = None
    inline: dict[str, Any] | None = field(default=None, hash=False)
    sp_size: int | None = None
    sp_env: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()

    def load_config(self, script_args: Sequence[str]) -> tuple[str, dict[str, Any], str]:
        if self.config_path is not None:
            where = (f"deepspeed_config_file of {shell_word(self.config_file)}" if self.yaml_names_config()
                     else f"${CONFIG_FILE_ENV}" if os.environ.get(CONFIG_FILE_ENV) == self.config_path
                     else "accelerate launch --deepspeed_config_file")
            return self.config_path, self._with_ulysses(load_ds_config(self.config_path), self.config_path), (
                f"{where}: {shell_word(self.config_path)}")
        where = (f"the deepspeed_config fields of {shell_word(self.config_file)}" if self.config_file
                 else "accelerate launch's options")
        path = f"{self.config_file or 'accelerate launch'} (inline DeepSpeed fields)"
        return path, self._with_ulysses(copy.deepcopy(self.inline), path), (
            f"{where}, as Accelerate's DeepSpeedPlugin builds them")

    def _with_ulysses(self, config: dict[str, Any], path: str) -> dict[str, Any]:
        """``config`` with the launch's Ulysses degree as its ``sequence_parallel_size`` where it sets none.

        Raises:
            ConfigError: naming ``path`` and the key: degrees that leave out the launch's, or degrees above 1 with no
                Accelerate config to carry them (``accelerate launch`` reads a ``parallelism_config`` for DeepSpeed
                from its config file only: its ``--use_parallelism_config`` is FSDP 2's).
        """
        listed = config.get(SP_KEY)
        degrees = listed if isinstance(listed, list) else [] if listed is None else [listed]
        if self.sp_size is not None and self.sp_size > 1:
            if listed is None:
                return {**config, SP_KEY: self.sp_size}
            if self.sp_size not in degrees:
                raise ConfigError(f"{path}: '{SP_KEY}' = {listed!r} leaves out the Ulysses degree {self.sp_size} of "
                                  f"the launch's parallelism_config (parallelism_config_sp_size): list it, or set one")
        elif self.config_file is None and any(isinstance(d, int) and d > 1 for d in degrees):
            raise ConfigError(f"{path}: '{SP_KEY}' = {listed!r}: accelerate launch gives DeepSpeed a Ulysses degree "
                              "only from its config file's parallelism_config: name an Accelerate config with "
                              "--config_file")
        return config

    def yaml_names_config(self) -> bool:
        """Whether the YAML's ``deepspeed_config_file`` names the config."""
        return bool((self.yaml.get("deepspeed_config") or {}).get("deepspeed_config_file"))

    def rank_env(self, config_path: str | None) -> dict[str, str]:
        """Accelerate's variables for the experiment's config at ``config_path``: the file, and its Ulysses degree d
        (``sequence_parallel_size``) as the ``parallelism_config`` variables of d (`sp_env`); at d = 1 after a
        launch with a ``parallelism_config``, none (`USE_PARALLELISM` false: under DeepSpeed it carries the
        degree only)."""
        env = dict(self.env)
        if config_path is not None:
            env[CONFIG_FILE_ENV] = config_path
            degree = int(load_ds_config(config_path).get(SP_KEY, 1))
            if degree > 1 or self.sp_size is not None:
                env = {k: v for k, v in env.items() if not k.startswith("PARALLELISM_CONFIG_")}
                env.update({USE_PARALLELISM: "false", **dict(dict(self.sp_env).get(degree, ()))})
        return env

    def answer(self, script: str, script_args: Sequence[str], config_path: str, results_dir: Path,
               ds_config: dict | None = None) -> Answer:
        words = _without_inline_options(self.words)
        files: tuple[tuple[str, str], ...] = ()
        config = ds_config if ds_config is not None else load_ds_config(config_path)
        sp = int(config.get(SP_KEY, 1))
        if self.config_file is not None:
            yaml_path = str(Path(results_dir).absolute() / ANSWER_YAML)
            text = answer_yaml(self.yaml, config_path, inline=self.config_path is None,
                               ulysses=(sp, int(self.ranks_per_node or 1)))
            files = ((ANSWER_YAML, text),)
            words = _set_option(words, "--config_file", yaml_path)
            for name, value in ulysses_fields(sp, int(self.ranks_per_node or 1)).items():  # given over the YAML's
                flag = f"--{name}"
                if any(w == flag or w.startswith(flag + "=") for w in words):
                    words = _set_option(words, flag, str(value))
        else:
            words = _set_option(words, "--deepspeed_config_file", config_path)
        return Answer((*words, script, *script_args), files)


def answer_yaml(yaml: dict[str, Any], config_path: str, inline: bool, ulysses: tuple[int, int] = (1, 1)) -> str:
    """The text of the user's Accelerate ``yaml`` with ``deepspeed_config_file`` naming ``config_path`` and the inline
    fields it replaces left out; where the config was built from inline fields, ``mixed_precision`` too (it is in the
    config, and Accelerate refuses it from the YAML beside a config file). ``ulysses``, (the config's Ulysses degree d,
    the ranks n): above 1, a ``parallelism_config`` holding `ulysses_fields` of (d, n); at 1, none."""
    import yaml as pyyaml
    out = copy.deepcopy(yaml)
    ds = {k: v for k, v in (out.get("deepspeed_config") or {}).items() if k not in INLINE_FIELDS}
    ds["deepspeed_config_file"] = config_path
    out["deepspeed_config"] = ds
    if inline:
        out.pop("mixed_precision", None)
    sp, ranks = ulysses
    given = out.pop("parallelism_config", None) or {}
    if sp > 1:
        out["parallelism_config"] = {**given, **ulysses_fields(sp, ranks)}
    return pyyaml.safe_dump(out, sort_keys=False)


def ulysses_fields(degree: int, ranks: int) -> dict[str, Any]:
    """Accelerate's ``parallelism_config`` fields (its YAML keys, its ``launch`` options without ``--``) for a Ulysses
    degree over ``ranks`` ranks: ``sp_size`` the degree over DeepSpeed, the other ranks as data-parallel shards
    (``dp_shard_size`` ranks / degree: Accelerate counts a step's samples over those), no replicas."""
    return {"parallelism_config_sp_size": degree, "parallelism_config_sp_backend": "deepspeed",
            "parallelism_config_dp_shard_size": ranks // degree, "parallelism_config_dp_replicate_size": 1}


def _set_option(words: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    """``words`` with ``flag``'s value set to ``value``: replaced where it is given, else added after ``launch``."""
    out, i, found = [], 0, False
    while i < len(words):
        if words[i] == flag and i + 1 < len(words):
            out += [flag, value]
            i, found = i + 2, True
            continue
        out.append(f"{flag}={value}" if words[i].startswith(flag + "=") else words[i])
        found = found or words[i].startswith(flag + "=")
        i += 1
    if not found:
        at = out.index("launch") + 1 if "launch" in out else len(out)
        out[at:at] = [flag, value]
    return tuple(out)


def _without_inline_options(words: Sequence[str]) -> tuple[str, ...]:
    """``words`` less the inline DeepSpeed options (each with its value) and ``--deepspeed_config_file``."""
    drop = tuple(f"--{name}" for name in (*INLINE_FIELDS, "deepspeed_config_file"))
    out, i = [], 0
    while i < len(words):
        if words[i] in drop:
            i += 2
        elif words[i].split("=", 1)[0] in drop:
            i += 1
        else:
            out.append(words[i])
            i += 1
    return tuple(out)


def read_accelerate(words: Sequence[str], launcher_words: int) -> tuple[AccelerateLauncher, str, list[str]]:
    """Read ``accelerate launch [options] SCRIPT ARGS...`` (its first ``launcher_words`` words name Accelerate's
    launcher) as ``accelerate launch`` does: ``(launcher, script, script arguments)``.

    Raises:
        ConfigError: naming the word, the file or the key: options Accelerate refuses, a config file that is
            missing or not Accelerate's, a launch that is not DeepSpeed's (``distributed_type``, ``use_cpu``),
            several machines, ``--module`` or ``--no_python``.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    head, rest = " ".join(words[:launcher_words]), list(words[launcher_words:])
    try:
        args = launch_command_parser().parse_args(rest)
    except SystemExit:
        raise ConfigError(f"{head}: its options, as Accelerate reads them, are refused (see above)") from None
    config_file = args.config_file or _default_config_file()
    yaml = _yaml(config_file) if config_file else {}  # read first: a file that cannot be read is named as ours are
    try:
        args, defaults, _ = _validate_launch_command(args)
    except Exception as e:  # Accelerate's own checks and loader: ValueError, KeyError, TypeError, yaml errors
        where = config_file or head
        raise ConfigError(f"{where}: {_YAML_RULE if config_file else 'refused by accelerate launch'}: "
                          f"{type(e).__name__}: {e}") from None
    _check_deepspeed(args, config_file, head)
    config_path = args.deepspeed_config_file or os.environ.get(CONFIG_FILE_ENV) or None
    env, inline = _accelerate_env(args, defaults, inline=not config_path)
    ranks = int(args.num_processes)
    launcher = AccelerateLauncher(words=tuple(words[:len(words) - len(args.training_script_args) - 1]),
                                  ranks_per_node=ranks, num_nodes=1, config_in_argv=False,
                                  config_file=config_file, yaml=yaml, env=tuple(sorted(env.items())),
                                  config_path=str(config_path) if config_path else None,
                                  inline=None if config_path else inline,
                                  sp_size=int(args.parallelism_config_sp_size) if args.use_parallelism_config else None,
                                  sp_env=_ulysses_env(args, ranks))
    return launcher, args.training_script, list(args.training_script_args)


def _default_config_file() -> str | None:
    """Accelerate's default config, which ``accelerate launch`` reads when given none, where it exists."""
    from accelerate.commands.config.config_args import default_config_file
    return default_config_file if os.path.isfile(default_config_file) else None


def _yaml(path: str) -> dict[str, Any]:
    import yaml
    text = user_files.read_text(path, f"Accelerate config {path}", _YAML_RULE)
    content = yaml.safe_load(text) if not path.endswith(".json") else user_files.loads(text)
    return content if isinstance(content, dict) else {}


def _check_deepspeed(args, config_file: str | None, head: str) -> None:
    where = config_file or head
    if not args.use_deepspeed or args.cpu:
        why = "use_cpu is set" if args.cpu else "distributed_type is not DEEPSPEED and there is no --use_deepspeed"
        raise ConfigError(f"{where}: not a DeepSpeed launch ({why}): zerotune tunes DeepSpeed jobs")
    if int(args.num_machines or 1) > 1:
        raise ConfigError(f"{where}: num_machines {args.num_machines}: zerotune starts every rank of an accelerate job "
                          "on one node; for several nodes run it inside a Slurm allocation with --backend slurm")
    if args.module or args.no_python:
        raise ConfigError(f"{head} {'--module' if args.module else '--no_python'}: zerotune tunes a training script "
                          "given by its path")


def _accelerate_env(args, defaults, inline: bool) -> tuple[dict[str, str], dict[str, Any] | None]:
    """(the variables Accelerate gives every rank of a launch whose DeepSpeed config is a file, with ``inline``
    the ds_config its ``DeepSpeedPlugin`` builds from the launch's inline fields, else None)."""
    from accelerate.utils import DeepSpeedPlugin, patch_environment
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    fields = list(defaults.deepspeed_config.keys()) if defaults and defaults.deepspeed_config else []
    user = copy.deepcopy(args)
    user.main_process_port = user.main_process_port or 29500
    user.deepspeed_fields_from_accelerate_config = ",".join(fields)
    built = None
    if inline:
        _, user_env = prepare_deepspeed_cmd_env(copy.deepcopy(user))
        with patch_environment(**{k: v for k, v in user_env.items() if k.startswith("ACCELERATE_")}):
            plugin = DeepSpeedPlugin()
            plugin.set_mixed_precision(str(args.mixed_precision).lower())
        built = _json_safe(plugin.deepspeed_config)
    filed = copy.deepcopy(user)
    for name in (*INLINE_FIELDS, "deepspeed_config_file"):
        setattr(filed, name, None)
    filed.deepspeed_fields_from_accelerate_config = ",".join(f for f in fields if f not in INLINE_FIELDS)
    _, env = prepare_deepspeed_cmd_env(filed)
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v and k != CONFIG_FILE_ENV}
    return changed, built


def _ulysses_env(args, ranks: int) -> tuple[tuple[int, tuple[tuple[str, str], ...]], ...]:
    """For each Ulysses degree d above 1 that divides ``ranks``, the variables ``accelerate launch`` gives every rank
    (``prepare_extend_env_parallelism_config``) where the launch's ``parallelism_config`` holds `ulysses_fields`."""
    from accelerate.utils.launch import prepare_extend_env_parallelism_config
    out = []
    for degree in (d for d in range(2, ranks + 1) if ranks % d == 0):
        given = copy.copy(args)
        for name, value in ulysses_fields(degree, ranks).items():
            setattr(given, name, value)
        out.append((degree, tuple(sorted(prepare_extend_env_parallelism_config(given, {}).items()))))
    return tuple(out)


def _json_safe(config: Any) -> Any:
    """``config`` without the values JSON cannot hold or DeepSpeed reads as unset: None, and infinities
    (Accelerate's ``steps_per_print``)."""
    if isinstance(config, dict):
        return {k: _json_safe(v) for k, v in config.items()
                if v is not None and not (isinstance(v, float) and math.isinf(v))}
    return config
