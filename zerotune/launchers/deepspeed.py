"""``deepspeed [options] SCRIPT ARGS...`` after ``--``, read by DeepSpeed's own runner parser.

Its options (``--hostfile``, ``--include``, ``--exclude``, ``--num_nodes``, ``--num_gpus``) select the device slots
as zerotune's own options of those names do; its experiments and answer are `zerotune.deepspeed.launcher`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zerotune.core.errors import ConfigError
from zerotune.launchers.base import Launcher

__all__ = ["RUNNER_OPTIONS", "DeepSpeedLauncher", "read_deepspeed"]

RUNNER_OPTIONS = ("hostfile", "include", "exclude", "num_nodes", "num_gpus", "master_port")
"""The runner's options zerotune's launcher options of the same names take: the device slots, and the answer's port
(each experiment takes a free one)."""
_SPELLINGS = {"num_gpus": ("--num_gpus", "--num_accelerators")}


@dataclass(frozen=True)
class DeepSpeedLauncher(Launcher):
    """The ``deepspeed`` runner (the base class's behaviour); ``options``: ``(name, value)`` of each `RUNNER_OPTIONS`
    its command set."""

    options: tuple[tuple[str, object], ...] = ()

    def slot_options(self) -> dict[str, object]:
        return dict(self.options)


def read_deepspeed(words: Sequence[str], launcher_words: int) -> tuple[DeepSpeedLauncher, str, list[str]]:
    """Read ``deepspeed [options] SCRIPT ARGS...`` (its first ``launcher_words`` words name the runner) with
    DeepSpeed's own parser (``deepspeed.launcher.runner.parse_args``): ``(launcher, script, script arguments)``.

    Raises:
        ConfigError: options the runner's parser refuses; ``--module`` or ``--no_python``.
    """
    from deepspeed.launcher.runner import parse_args
    head, rest = " ".join(words[:launcher_words]), list(words[launcher_words:])
    try:
        args = parse_args(rest)
    except SystemExit:
        raise ConfigError(f"{head}: its options, as DeepSpeed's runner reads them, are refused (see above)") from None
    if args.module or args.no_python:
        raise ConfigError(f"{head} {'--module' if args.module else '--no_python'}: zerotune tunes a training script "
                          "given by its path")
    options = rest[:len(rest) - len(args.user_args) - 1]
    given = [o for o in RUNNER_OPTIONS if any(w.split("=", 1)[0] in _SPELLINGS.get(o, (f"--{o}",)) for w in options)]
    launcher = DeepSpeedLauncher(words=tuple(words[:len(words) - len(args.user_args) - 1]),
                                 options=tuple((o, getattr(args, o)) for o in given))
    return launcher, args.user_script, list(args.user_args)
