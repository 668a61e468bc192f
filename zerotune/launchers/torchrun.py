"""``torchrun`` and ``python -m torch.distributed.run``, read by torch's own argument parser.

Experiments start ranks as torchrun does (`zerotune.launchers.contract.TORCHRUN`): cold through torchrun on one node
with a static rendezvous at zerotune's port, warm forked with the same variables. The answer is the user's torchrun
line with the tuned config in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from zerotune.core.errors import ConfigError
from zerotune.launchers.base import Launcher, config_in_argv
from zerotune.launchers.contract import TORCHRUN

__all__ = ["TorchrunLauncher", "read_torchrun"]


@dataclass(frozen=True)
class TorchrunLauncher(Launcher):
    """``torchrun [options] SCRIPT ARGS...``: ranks get torchrun's environment and no ``--local_rank``."""

    name: ClassVar[str] = "torchrun"
    contract: ClassVar[str] = TORCHRUN


def read_torchrun(words: Sequence[str], launcher_words: int) -> tuple[TorchrunLauncher, str, list[str]]:
    """Read ``words`` (the whole command; its first ``launcher_words`` are ``torchrun`` or ``python -m
    torch.distributed.run``) with torch's own parser: ``(launcher, script, script arguments)``.

    Raises:
        ConfigError: options torch's parser refuses, ``--nnodes`` above 1 (several nodes: ``--backend slurm``),
            ``--module`` or ``--no-python``, an unreadable ``--nproc_per_node``, or no DeepSpeed config.
    """
    import torch.distributed.run as run
    head, rest = list(words[:launcher_words]), list(words[launcher_words:])
    args = _parse(run.get_args_parser(), rest, " ".join(head))
    try:
        _, max_nodes = run.parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{' '.join(head)} --nnodes {args.nnodes!r}: expected N or MIN:MAX") from None
    if max_nodes > 1:
        raise ConfigError(f"{' '.join(head)} --nnodes {args.nnodes}: zerotune starts every rank of a torchrun job on "
                          "one node, with a rendezvous of its own; for several nodes run it inside a Slurm "
                          "allocation with --backend slurm, or give the deepspeed form a hostfile")
    for flag, on in (("--module", args.module), ("--no-python", args.no_python)):
        if on:
            raise ConfigError(f"{' '.join(head)} {flag}: zerotune tunes a training script given by its path "
                              f"(python -m torch.distributed.run SCRIPT.py ...)")
    try:
        ranks = run.determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise ConfigError(f"{' '.join(head)} --nproc_per_node {args.nproc_per_node!r}: {e}") from None
    launcher = TorchrunLauncher(words=tuple(words[:len(words) - len(args.training_script_args) - 1]),
                                ranks_per_node=ranks, num_nodes=1,
                                config_in_argv=config_in_argv(args.training_script, args.training_script_args))
    return launcher, args.training_script, list(args.training_script_args)


def _parse(parser, words: list[str], prog: str):
    """``parser.parse_args(words)``, its usage error (argparse's exit 2) raised as a ConfigError naming ``prog``."""
    parser.prog = prog
    parser.exit_on_error = False
    try:
        return parser.parse_args(words)
    except SystemExit:
        raise ConfigError(f"{prog}: its options, as {prog} reads them, are refused (see above)") from None
    except Exception as e:  # argparse.ArgumentError
        raise ConfigError(f"{prog}: {e}") from None
