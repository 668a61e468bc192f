"""What every rank gets from the tuner's environment, on every node and every backend: one rule (D300).

The tuner's variables whose names start with `PASSED_PREFIXES` reach every rank of every experiment and of the
training after tuning, on every node, as set where ``zerotune`` runs; other names are left to each way ranks are
started. `zerotune.deepspeed.launcher.launch_env` adds them to each launch (``cmd.txt`` shows them): one node's ranks
inherit them, DeepSpeed's multi-node runner reads them from an env file (`runner_env_file`), Ray ships them in the
launch spec, Slurm's ``srun --export=ALL`` exports them.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from zerotune.core import user_files

__all__ = ["ENV_FILE_VAR", "PASSED_PREFIXES", "RUNNER_ENV_FILE", "passed_env", "runner_env_file", "user_env_texts"]

log = logging.getLogger(__name__)

PASSED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_")
"""Names starting with these are passed from the tuner's environment to every rank: NCCL's and Gloo's
settings, torch.distributed's own (``TORCH_NCCL_*``, ``TORCH_DISTRIBUTED_DEBUG``), UCX's and libfabric's
(``FI_*``: EFA, Slingshot)."""

ENV_FILE_VAR = "DS_ENV_FILE"
"""The variable that names DeepSpeed's runner env file (``deepspeed/launcher/runner.py``,
``DEEPSPEED_ENVIRONMENT_NAME``; default ``.deepspeed_env``, looked for in ``~`` and the working directory)."""
RUNNER_ENV_FILE = "deepspeed_env"
"""A multi-node run's env file, in its experiment directory (the results dir for the training after tuning)."""
_DEFAULT_ENV_FILE = ".deepspeed_env"
_RUNNER_FORWARDS = "PYTHON"  # the runner forwards these itself, PYTHONPATH with its working directory first


def passed_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables of ``environ`` whose names start with `PASSED_PREFIXES`, sorted by name."""
    return {k: environ[k] for k in sorted(environ) if k.startswith(PASSED_PREFIXES)}


def user_env_texts(environ: Mapping[str, str] = os.environ, cwd: Path | None = None) -> list[str]:
    """The text of each env file DeepSpeed's runner reads (``~/NAME`` and ``cwd/NAME``, ``NAME`` being ``environ``'s
    ``DS_ENV_FILE`` or ``.deepspeed_env``; an absolute ``NAME`` once) that is a regular file, read as every user file
    is (`zerotune.core.user_files`).

    Raises:
        ConfigError: naming the env file: unreadable, larger than 4 MiB or not UTF-8.
    """
    own = environ.get(ENV_FILE_VAR, _DEFAULT_ENV_FILE)
    folders = (Path.home(), Path(cwd) if cwd is not None else Path.cwd())
    return [user_files.read_text(user_file, f"DeepSpeed env file {user_file}", "expected NAME=VALUE lines, UTF-8")
            for user_file in dict.fromkeys((folder / own).resolve() for folder in folders) if user_file.is_file()]


def runner_env_file(env: Mapping[str, str], path: Path, environ: Mapping[str, str] = os.environ,
                    cwd: Path | None = None) -> dict[str, str]:
    """Write DeepSpeed's runner env file at ``path`` so that a multi-node launch's ranks on every node get ``env``
    (`zerotune.deepspeed.launcher.launch_env`); return the variable naming it (``{"DS_ENV_FILE": path}``, absolute, as
    the runner joins a relative name to its directories). The runner forwards by itself only names starting with its
    ``EXPORT_ENVS`` (``PYTHON``, ``UCX``, ``NCCL`` on CUDA...), so every other variable must be in the file.

    The file holds a ``NAME=VALUE`` line per variable of ``env``, except ``PYTHON*`` (the runner forwards them,
    ``PYTHONPATH`` with its working directory first) and values holding a line break (logged and left out); then the
    lines of the env files the runner would have read without it (`user_env_texts`; ``cwd``: the runner's working
    directory, None for this process's), which win as they do in the runner.

    Raises:
        ConfigError: an env file that cannot be read (`user_env_texts`).
    """
    lines = []
    for name, value in env.items():
        if name.startswith(_RUNNER_FORWARDS):
            continue
        if "\n" in value or "\r" in value:
            log.warning("%s holds a line break: it is not passed to the ranks on other nodes", name)
            continue
        lines.append(f"{name}={value}\n")
    lines += [text if text.endswith("\n") or not text else text + "\n" for text in user_env_texts(environ, cwd)]
    path = Path(path).absolute()
    path.write_text("".join(lines))
    return {ENV_FILE_VAR: str(path)}
