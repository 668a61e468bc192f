"""``python SCRIPT ARGS...``: a script that starts its own ranks (Lightning's ``DeepSpeedStrategy``), or one rank.

zerotune starts one process per experiment, as the user does, and gives it nothing of a rank's
(:data:`~zerotune.launchers.contract.OWN`): the script's own launcher forks or spawns its ranks, so the run cannot be
warm. The number of ranks is the script's to choose at run time: ``--num_gpus`` tells zerotune what it will be. The
DeepSpeed config is the one its arguments name, else the one ``PL_DEEPSPEED_CONFIG_PATH`` names (Lightning's
``DeepSpeedStrategy`` reads it when it is given no config), which each experiment then sets to its own.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.config import CONFIG_FLAGS, load_ds_config
from zerotune.launchers.base import Launcher
from zerotune.launchers.contract import OWN

__all__ = ["LIGHTNING_CONFIG_ENV", "PythonLauncher", "read_python"]

LIGHTNING_CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"
"""Lightning's ``DeepSpeedStrategy`` reads its config from this file when it is given none
(``lightning/pytorch/strategies/deepspeed.py``)."""


@dataclass(frozen=True)
class PythonLauncher(Launcher):
    """``python [-u] SCRIPT ARGS...``: the script starts its own ranks; zerotune starts it alone, cold."""

    name: ClassVar[str] = "python"
    contract: ClassVar[str] = OWN

    def load_config(self, script_args: Sequence[str]) -> tuple[str, dict[str, Any], str]:
        if self.config_in_argv:
            return super().load_config(script_args)
        path = os.environ[LIGHTNING_CONFIG_ENV]
        return path, load_ds_config(path), f"${LIGHTNING_CONFIG_ENV} = {path}"

    def rank_env(self, config_path: str | None) -> dict[str, str]:
        return {} if self.config_in_argv or config_path is None else {LIGHTNING_CONFIG_ENV: config_path}

    def command(self, script: str, script_args: Sequence[str], ranks: int, master_port: int) -> list[str]:
        return [sys.executable, "-u", script, *script_args]

    def warm_note(self) -> str:
        return "python SCRIPT starts its own ranks (the script's launcher forks them), so its runs go cold"


def read_python(words: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[PythonLauncher, str, list[str]]:
    """Read ``python [-u] [-X OPT] SCRIPT ARGS...``: ``(launcher, script, script arguments)``.

    Raises:
        ConfigError: no script, ``-m``/``-c`` (zerotune tunes a script by its path), or an interpreter option it
            does not know.
    """
    i = 1
    while i < len(words) and words[i].startswith("-"):
        if words[i] in ("-u", "-B", "-O", "-OO", "-s", "-E"):
            i += 1
        elif words[i] in ("-X", "-W"):
            i += 2
        else:
            raise ConfigError(f"{' '.join(words[:i + 1])}: zerotune reads 'python [-u] SCRIPT ARGS...', "
                              "'python -m torch.distributed.run ...' or 'python -m deepspeed.launcher.runner ...'")
    if i >= len(words):
        raise ConfigError(f"{' '.join(words)}: no training script after {words[0]}")
    script, args = words[i], list(words[i + 1:])
    in_argv = any(a in CONFIG_FLAGS or a.split("=", 1)[0] in CONFIG_FLAGS for a in args)
    if not in_argv and not environ.get(LIGHTNING_CONFIG_ENV):
        raise ConfigError(f"{script}: no DeepSpeed config: pass --deepspeed ds_config.json in its arguments, or set "
                          f"{LIGHTNING_CONFIG_ENV} to the config a Lightning DeepSpeedStrategy reads")
    return PythonLauncher(words=tuple(words[:i]), config_in_argv=in_argv), script, args
