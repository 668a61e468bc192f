"""The ``deepspeed`` launcher's command line: which executable, which environment, which arguments.

Everything here is text: the command a backend starts (and writes to ``cmd.txt``) and the line a person can paste,
always the ``deepspeed`` runner's. An experiment on this machine alone starts DeepSpeed's per-node launcher directly
with the arguments the runner would hand it (`launch_command`, ``direct``), saving the runner's second or two (D14).
Starting, supervising and stopping the process is the backends' job (`zerotune.run.backends.local`).
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import socket
import sys
import threading
from pathlib import Path

from zerotune.core.launch import LaunchSpec, Reservation
from zerotune.deepspeed.args import apply_arg_mappings, raise_steps
from zerotune.deepspeed.config import replace_config_arg
from zerotune.deepspeed.extensions import extensions_dir
from zerotune.deepspeed.rank_env import passed_env
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV, PROBE_PATH

__all__ = ["deepspeed_launcher", "free_port", "launch_command", "launch_env", "multi_node", "node_launcher",
           "paste_command", "release_port", "script_arguments", "shell_word"]

_port_lock = threading.Lock()
_ports_in_use: set[int] = set()


def free_port() -> int:
    """A free TCP port no other running experiment holds (``--master_port``); give it back with `release_port`.

    Raises:
        RuntimeError: no such port was found in 100 tries.
    """
    with _port_lock:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_in_use:
                _ports_in_use.add(port)
                return port
    raise RuntimeError("no free TCP port for the launcher's master_port")


def release_port(port: int) -> None:
    """Let `free_port` hand ``port`` out again."""
    with _port_lock:
        _ports_in_use.discard(port)


def deepspeed_launcher() -> list[str]:
    """The ``deepspeed`` launcher of this Python environment."""
    exe = Path(sys.executable).with_name("deepspeed")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def node_launcher() -> list[str]:
    """DeepSpeed's per-node launcher, ``python -u -m deepspeed.launcher.launch``: what the ``deepspeed``
    runner execs for a single-node run (``deepspeed/launcher/runner.py``), started by this environment's Python."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]


DEFAULT_MASTER_PORT = 29500
"""DeepSpeed's runner's default ``--master_port`` (``TORCH_DISTRIBUTED_DEFAULT_PORT``): the answer's, unless the user
gave one."""
MIMALLOC_RESERVE_ENV = "MIMALLOC_ARENA_RESERVE"
"""mimalloc's arena reservation (pyarrow's default memory pool, which transformers' Trainer imports with ``datasets``
installed, reserves 1 GiB of address space at its first allocation): ``RLIMIT_DATA``, the CPU ranks' budget, counts
that reservation though no page backs it (``VmData`` 443 -> 1,533 MiB after the Trainer's imports), so an
experiment's CPU ranks under a budget get 0 (none ahead; the user's own value stands)."""


def launch_env(spec: LaunchSpec, reservation: Reservation, probe_dir: Path | None = None,
               config_path: str | None = None) -> dict[str, str]:
    """Environment variables the launch needs beyond the caller's (shown in ``cmd.txt``), each later one winning: the
    ranks' communication settings (`zerotune.deepspeed.rank_env.passed_env`), ``spec.extra_env``, the user's
    launcher's variables for the config at ``config_path`` (``spec.launcher.rank_env``), then the launch's own.

    ``probe_dir``, an experiment's directory, puts the step probe (`zerotune.probe`) first on the ranks'
    ``PYTHONPATH``, writing its streams there; with a budget, the probe caps each CUDA device's caching allocator at it
    (bytes) and CPU ranks reserve no mimalloc arena (`MIMALLOC_RESERVE_ENV`). None (the optimal command, ``zerotune
    run``): no probe, no cap.
    """
    env = {**passed_env(), **spec.extra_env}
    if spec.launcher is not None:
        env.update(spec.launcher.rank_env(config_path))
    if probe_dir is not None:
        inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE_PATH), inherited) if p)
        env[PROBE_DIR_ENV] = str(Path(probe_dir).resolve())
        # the exps dir's own extension cache, once the scheduler or tuner made it (zerotune.deepspeed.extensions)
        own = extensions_dir(Path(probe_dir).resolve().parent)
        if own.is_dir():
            env["TORCH_EXTENSIONS_DIR"] = str(own)
        if not spec.cpu and spec.device_memory_bytes:  # the probe caps each CUDA device's allocator at it
            env[BUDGET_ENV] = str(int(spec.device_memory_bytes))
    if spec.launcher is not None and not spec.cpu:  # the slots, as a user sets them before torchrun
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in reservation.nodes[0].slots)
    if spec.cpu and spec.device_memory_bytes and probe_dir is not None and MIMALLOC_RESERVE_ENV not in os.environ:
        env[MIMALLOC_RESERVE_ENV] = "0"  # the budget counts what a rank allocates, not an arena it reserves
    if spec.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        # The launcher counts CPU "devices" from LOCAL_SIZE; it must cover the highest slot id.
        env["LOCAL_SIZE"] = str(max(max(n.slots) for n in reservation.nodes) + 1)
    return env


def launch_command(spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                   direct: bool = False, ds_config: dict | None = None) -> list[str]:
    """The launcher command for a config on a reservation, with the script's arguments of `script_arguments`.

    Multi-node reservations go through the ``deepspeed`` runner (``--hostfile --force_multi``, `multi_node`). With
    ``direct``, a reservation of this machine alone starts `node_launcher` with the arguments the runner would give
    it (``--world_info``: base64 of the JSON ``{"localhost": [slots]}``, ``--master_addr 127.0.0.1``,
    ``--master_port``); otherwise the runner with ``--include``. With ``spec.launcher`` (not the ``deepspeed`` form),
    that launcher's command on the reservation's one node.
    """
    if spec.launcher is not None:
        return spec.launcher.command(spec.script, script_arguments(spec, config_path, ds_config),
                                     reservation.world_size, master_port)
    if direct and [n.host for n in reservation.nodes] == ["localhost"]:  # this machine alone
        world = json.dumps({"localhost": list(reservation.nodes[0].slots)}).encode()
        cmd = node_launcher() + ["--world_info", base64.urlsafe_b64encode(world).decode(), "--master_addr",
                                 "127.0.0.1", "--master_port", str(master_port), spec.script]
    else:
        cmd = deepspeed_launcher()
        if multi_node(spec, reservation):
            cmd += ["--hostfile", spec.hostfile, "--force_multi"]
        cmd += ["--include", reservation.include_arg(), "--master_port", str(master_port), spec.script]
    return cmd + script_arguments(spec, config_path, ds_config)


def multi_node(spec: LaunchSpec, reservation: Reservation) -> bool:
    """Whether the launch goes through the runner's multi-node path (``--hostfile --force_multi``): a hostfile
    and a host other than ``localhost``."""
    return bool(spec.hostfile) and any(n.host != "localhost" for n in reservation.nodes)


def script_arguments(spec: LaunchSpec, config_path: str, ds_config: dict | None = None) -> list[str]:
    """The script's arguments for one launch: ``spec.script_args`` with the ds_config argument replaced by
    ``config_path`` (unless the launcher carries the config itself), the values ``spec.arg_mappings`` maps from that
    config (``ds_config``: its content where not written yet) and, with ``spec.max_steps_arg``, an experiment's steps
    flag raised (`zerotune.deepspeed.args`)."""
    args = (spec.launcher.script_arguments(spec.script_args, config_path) if spec.launcher is not None
            else replace_config_arg(list(spec.script_args), config_path))
    if spec.arg_mappings or spec.max_steps_arg:
        config = json.loads(Path(config_path).read_text()) if ds_config is None else ds_config
        args = apply_arg_mappings(args, dict(spec.arg_mappings), config)
        if spec.max_steps_arg:
            args = raise_steps(args, spec.max_steps_arg, config)
    return args


def paste_command(env: dict[str, str], cmd: list[str]) -> str:
    """A shell line a person can paste: each word as `shell_word` quotes it, so the line is text (valid
    UTF-8) whatever bytes the paths and arguments hold."""
    prefix = " ".join(f"{k}={shell_word(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + " ".join(shell_word(arg) for arg in cmd)


def shell_word(word: str) -> str:
    """``word`` quoted for the shell: `shlex.quote` when it is text; when it holds bytes that are not UTF-8 (surrogate
    escapes, as ``sys.argv`` and `os.fsdecode` give them), bash's ``$'...'`` with each byte outside printable ASCII as
    ``\\xNN``, so the program gets the user's very bytes and the line stays printable."""
    try:
        word.encode()
    except UnicodeEncodeError:
        return "$'" + "".join(chr(b) if 0x20 <= b < 0x7F and chr(b) not in "'\\" else f"\\x{b:02x}"
                              for b in os.fsencode(word)) + "'"
    return shlex.quote(word)
