"""The user's own command after ``--``: which launcher it is, read by that launcher's own parser (D314).

``zerotune tune [options] -- COMMAND...`` takes COMMAND as the user types it to train (`read_command`): ``deepspeed``
by DeepSpeed's runner parser, ``torchrun`` by torch's, ``accelerate launch`` by Accelerate's (each also as ``python
-m`` its module), ``python [-u] SCRIPT`` as a script that starts its own ranks, or is one. Anything else is refused
before anything runs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

from zerotune.core.errors import ConfigError
from zerotune.launchers.base import Launcher

__all__ = ["KNOWN", "UserCommand", "read_command"]

KNOWN = ("deepspeed", "torchrun", "python -m torch.distributed.run", "accelerate launch", "python SCRIPT")
"""The launchers `read_command` reads, as its messages name them."""
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_MODULES = {"torch.distributed.run": "torchrun", "deepspeed.launcher.runner": "deepspeed",
            "accelerate.commands.launch": "accelerate"}


@dataclass(frozen=True)
class UserCommand:
    """The user's command, read: its ``launcher``, the training ``script`` and the script's arguments."""

    launcher: Launcher
    script: str
    script_args: tuple[str, ...]


def read_command(words: Sequence[str]) -> UserCommand:
    """Read the user's training command ``words`` (the module's forms).

    Raises:
        ConfigError: an empty command, a word naming no launcher zerotune knows (`KNOWN`), or what the launcher's
            own reader refuses.
    """
    words = list(words)
    if not words:
        raise ConfigError(f"no command after '--': expected the command you train with ({', '.join(KNOWN)})")
    name = os.path.basename(words[0])
    if _PYTHON.match(name) and words[1:2] == ["-m"] and len(words) > 2:
        kind, launcher_words = _MODULES.get(words[2]), 3
        if kind is None:
            raise ConfigError(f"'{words[0]} -m {words[2]}': not a launcher zerotune knows ({', '.join(KNOWN)})")
    elif name == "accelerate":
        if words[1:2] != ["launch"]:
            raise ConfigError(f"'{' '.join(words[:2])}': zerotune reads 'accelerate launch ...' "
                              f"(launchers known: {', '.join(KNOWN)})")
        kind, launcher_words = "accelerate", 2
    else:
        kind, launcher_words = ("python" if _PYTHON.match(name) else name), 1
    return UserCommand(*_read(kind, words, launcher_words))


def _read(kind: str, words: list[str], launcher_words: int):
    """``(launcher, script, script arguments)`` of ``words``, by the reader of launcher ``kind``."""
    if kind == "deepspeed":
        from zerotune.launchers.deepspeed import read_deepspeed
        launcher, script, args = read_deepspeed(words, launcher_words)
    elif kind == "torchrun":
        from zerotune.launchers.torchrun import read_torchrun
        launcher, script, args = read_torchrun(words, launcher_words)
    elif kind == "accelerate":
        from zerotune.launchers.accelerate import read_accelerate
        launcher, script, args = read_accelerate(words, launcher_words)
    elif kind == "python":
        from zerotune.launchers.python import read_python
        launcher, script, args = read_python(words)
    elif kind == "srun":
        raise ConfigError(f"'{' '.join(words[:3])} ...': zerotune starts each experiment's job step itself: run it "
                          "inside the allocation with --backend slurm, followed by '--' and the command srun starts "
                          "on each node (deepspeed, torchrun, accelerate launch)")
    else:
        raise ConfigError(f"'{words[0]}': not a launcher zerotune knows ({', '.join(KNOWN)}); put the command "
                          "you train with after '--'")
    return launcher, script, tuple(args)
