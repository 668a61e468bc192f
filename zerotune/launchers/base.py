"""The user's launcher as zerotune reads and reproduces it: `Launcher`, one subclass per launcher (D314).

A launcher object is data (a frozen dataclass, shipped to Ray nodes in the launch spec) that says where the DeepSpeed
config is and how an experiment's config reaches the ranks (`Launcher.load_config`, `Launcher.rank_env`); how ranks
start (`Launcher.contract`: cold by `Launcher.command`, warm by the warm server applying the same contract); how many
ranks and nodes its options ask for; and the answer in the user's own form (`Launcher.answer`). A launch spec without
a launcher object is the ``deepspeed`` form, whose commands are `zerotune.deepspeed.launcher`'s.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.config import config_args, find_config_arg, load_ds_config, replace_config_arg
from zerotune.deepspeed.launcher import shell_word
from zerotune.launchers.contract import DEEPSPEED, TORCHRUN

__all__ = ["LIGHTNING_CONFIG_ENV", "Answer", "Launcher", "config_in_argv"]

LIGHTNING_CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"
"""Lightning's ``DeepSpeedStrategy`` reads its config from this file when it is given none
(``lightning/pytorch/strategies/deepspeed.py``): where a script's arguments carry no config, the launchers that
start a script's ranks as given (torchrun, python) take it from there, and each experiment sets it to its own."""


@dataclass(frozen=True)
class Answer:
    """The answer in the user's form: ``words`` (the command, the launcher first) and ``files`` to write beside
    ``ds_config_optimal.json`` (name -> text)."""

    words: tuple[str, ...]
    files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Launcher:
    """A user's launcher (abstract: see the subclasses).

    Attributes:
        words: the launcher's part of the user's command, before the script (``("torchrun", "--nproc_per_node", "2")``).
        ranks_per_node, num_nodes: what its options ask for (None: they do not say; ``--num_gpus`` does).
        config_in_argv: the ds_config path is in the script's arguments; False: the launcher carries it (its config
            file, or `LIGHTNING_CONFIG_ENV`) and `rank_env` passes each experiment's.
    """

    name: ClassVar[str] = DEEPSPEED
    contract: ClassVar[str] = DEEPSPEED
    words: tuple[str, ...] = ("deepspeed",)
    ranks_per_node: int | None = None
    num_nodes: int | None = None
    config_in_argv: bool = True

    def load_config(self, script_args: Sequence[str]) -> tuple[str, dict[str, Any], str]:
        """``(path, content, where)`` of the user's ds_config: ``where`` says how it was found, for the summary (its
        paths quoted as a shell line quotes them: printable whatever bytes they hold).

        Raises:
            ConfigError: no config, or one that cannot be read (naming the file).
        """
        if not self.config_in_argv:
            path = os.environ[LIGHTNING_CONFIG_ENV]
            return path, load_ds_config(path), f"${LIGHTNING_CONFIG_ENV} = {shell_word(path)}"
        index, path = find_config_arg(list(script_args))
        flag = script_args[index - 1] if script_args[index] == path else script_args[index].split("=", 1)[0]
        return path, load_ds_config(path), f"{shell_word(flag)} {shell_word(path)} in the script's arguments"

    def script_arguments(self, script_args: Sequence[str], config_path: str) -> list[str]:
        """The script's arguments with the ds_config path at ``config_path`` (unchanged where the launcher carries
        the config)."""
        return replace_config_arg(list(script_args), config_path) if self.config_in_argv else list(script_args)

    def rank_env(self, config_path: str | None) -> dict[str, str]:
        """What the launcher puts into every rank's environment besides its identity, for an experiment's config at
        ``config_path`` (None: the warm server's): the path in `LIGHTNING_CONFIG_ENV` where the arguments lack it."""
        return {} if self.config_in_argv or config_path is None else {LIGHTNING_CONFIG_ENV: config_path}

    def command(self, script: str, script_args: Sequence[str], ranks: int, master_port: int) -> list[str]:
        """The command that starts ``ranks`` ranks of ``script`` on this machine: for torchrun's contract, torch's
        elastic launcher (this Python's) for one node with a static rendezvous at ``127.0.0.1:master_port``; the
        ``deepspeed`` contract has none here (NotImplementedError)."""
        if self.contract != TORCHRUN:
            raise NotImplementedError(f"the {self.name} launcher's command is zerotune.deepspeed.launcher's")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(master_port), script, *script_args]

    def warm_note(self) -> str:
        """Why this launcher's ranks cannot be forked warm ('' when they can)."""
        return ""

    def slot_options(self) -> dict[str, object]:
        """zerotune's launcher options (``num_gpus``, ``num_nodes`` ...) as the command's own options give them."""
        given: dict[str, object] = {}
        if self.ranks_per_node is not None:
            given["num_gpus"] = self.ranks_per_node
        if self.num_nodes is not None:
            given["num_nodes"] = self.num_nodes
        return given

    def answer(self, script: str, script_args: Sequence[str], config_path: str, results_dir: Path,
               ds_config: dict | None = None) -> Answer:
        """The user's command with the tuned config at ``config_path`` (absolute; ``ds_config``: its content where
        the file is not written yet); ``script_args`` already carry the config's mapped values
        (``autotuning.arg_mappings``)."""
        return Answer((*self.words, script, *self.script_arguments(script_args, config_path)))

    def describe(self, script: str) -> str:
        """The launcher as the summary names it: ``torchrun (torchrun --nproc_per_node 2 train.py ...)``, each word
        quoted as a shell line quotes it (`zerotune.deepspeed.launcher.shell_word`)."""
        return f"{self.name} ({' '.join(shell_word(w) for w in (*self.words, script))} ...)"


def config_in_argv(script: str, script_args: Sequence[str]) -> bool:
    """Whether ``script_args`` carry the ds_config (a path after ``--deepspeed`` or ``--deepspeed_config``, as
    `zerotune.deepspeed.config.config_args` finds it); False where they do not and `LIGHTNING_CONFIG_ENV` names it.

    Raises:
        ConfigError: neither says where the config is, or a flag's path is the empty string.
    """
    if config_args(script_args):
        return True  # the one config is read, or two are refused, by find_config_arg when it is loaded
    if os.environ.get(LIGHTNING_CONFIG_ENV):
        return False
    raise ConfigError(f"{script}: no DeepSpeed config: pass --deepspeed ds_config.json in its arguments, or set "
                      f"{LIGHTNING_CONFIG_ENV} to the config a Lightning DeepSpeedStrategy reads")
