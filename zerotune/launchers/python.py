"""``python SCRIPT ARGS...``: a script that starts its own ranks (Lightning's ``DeepSpeedStrategy``), or one rank.

zerotune starts one process per experiment, as the user does, and gives it nothing of a rank's
(`zerotune.launchers.contract.OWN`), so the run cannot be warm; ``--num_gpus`` tells zerotune how many ranks the
script will start. The DeepSpeed config is the one its arguments name, else ``PL_DEEPSPEED_CONFIG_PATH``'s
(`zerotune.launchers.base.LIGHTNING_CONFIG_ENV`), which each experiment sets to its own.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar, Sequence

from zerotune.core.errors import ConfigError
from zerotune.launchers.base import Launcher, config_in_argv
from zerotune.launchers.contract import OWN

__all__ = ["PythonLauncher", "read_python"]


@dataclass(frozen=True)
class PythonLauncher(Launcher):
    """``python [-u] SCRIPT ARGS...``: the script starts its own ranks; zerotune starts it alone, cold."""

    name: ClassVar[str] = "python"
    contract: ClassVar[str] = OWN

    def command(self, script: str, script_args: Sequence[str], ranks: int, master_port: int) -> list[str]:
        return [sys.executable, "-u", script, *script_args]

    def warm_note(self) -> str:
        return "python SCRIPT starts its own ranks (the script's launcher forks them), so its runs go cold"


def read_python(words: Sequence[str]) -> tuple[PythonLauncher, str, list[str]]:
    """Read ``python [-u] [-X OPT] SCRIPT ARGS...``: ``(launcher, script, script arguments)``.

    Raises:
        ConfigError: no script, ``-m``/``-c`` (zerotune tunes a script by its path), an interpreter option it
            does not know, or no DeepSpeed config (`zerotune.launchers.base.config_in_argv`).
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
    return PythonLauncher(words=tuple(words[:i]), config_in_argv=config_in_argv(script, args)), script, args
