"""DeepSpeed's JIT-built ops and the torch extension cache the experiments load them from.

DeepSpeed builds its CPU ops (the shared-memory comm, fused Adam) with torch's JIT extension
loader on first use, into ``$TORCH_EXTENSIONS_DIR/<op>/`` (default
``~/.cache/torch_extensions/py311_cpu/<op>/``). Every process that loads an op, even one built long
ago, takes ``<op>/lock`` while it checks the build (torch's ``FileBaton``; a fresh process always
runs the check), and waits, without a timeout and without a word, while another process holds it.
A rank killed inside that window (a timeout, a hang, Ctrl-C, a reap) leaves the lock behind, and
from then on every DeepSpeed run on the machine that loads the op waits on it forever.

So zerotune's experiments never use the machine's cache: each exps dir has its own
(:func:`extensions_dir`, ``<exps_dir>/.torch_extensions``), seeded from the machine's already-built
ops (:func:`seed`, so nothing is rebuilt), and only this tuner's experiments load from it (the
results-dir lock keeps a second tuner out). A lock there while none of its experiments runs can
only be left by a killed process: :func:`remove_stale_locks` removes it, and a run that timed out
while a lock older than the run was present says so by path (:func:`stale_locks`).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["EXTENSIONS_DIR", "LOCK_FILE", "default_root", "extensions_dir", "remove_stale_locks", "seed",
           "stale_locks"]

EXTENSIONS_DIR = ".torch_extensions"  # under the exps dir
LOCK_FILE = "lock"  # torch.utils.file_baton.FileBaton's file in each op's build directory
BUILD_S = 600.0  # a lock younger than this in the machine's cache may be a build in progress


def extensions_dir(exps_dir: Path) -> Path:
    """The experiments' ``TORCH_EXTENSIONS_DIR`` for an exps dir (absolute)."""
    return Path(exps_dir).resolve() / EXTENSIONS_DIR


def default_root(environ: dict[str, str] | None = None) -> Path:
    """Where torch builds extensions for a process started with ``environ`` (default: this one's):
    ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py<ver>_<cpu|cuXY|rocmXY>``, as
    ``torch.utils.cpp_extension._get_build_directory`` decides."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{accelerator}"


def seed(target: Path, source: Path | None = None) -> list[str]:
    """Copy each op built in ``source`` (default :func:`default_root`) that ``target`` lacks, with
    its timestamps (so torch's build check finds it up to date), never a lock; returns the ops
    copied. An op being built in ``source`` right now (its lock younger than ``BUILD_S``) is
    skipped: the experiments then build it themselves, in ``target``."""
    source = default_root() if source is None else Path(source)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    try:
        ops = sorted(p for p in source.iterdir() if p.is_dir())
    except OSError:
        return copied
    for op in ops:
        if (target / op.name).exists() or stale_locks(op.parent, time.time() - BUILD_S, op.name) != \
                stale_locks(op.parent, None, op.name) or not any(op.glob("*.so")):
            continue
        partial = target / f".{op.name}.seeding"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            shutil.copytree(op, partial, ignore=shutil.ignore_patterns(LOCK_FILE), symlinks=True,
                            copy_function=_link_or_copy)
            partial.rename(target / op.name)  # whole or not at all
            copied.append(op.name)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    return copied


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link the build's objects and libraries (50 MB for fused Adam), copy the rest. Safe: a
    rebuild never writes into them in place (binutils and ninja unlink an output before writing it),
    while ninja's own files (``.ninja_log``, ``.ninja_deps``, ``build.ninja``), which are appended to
    or rewritten in place, are always copied."""
    if src.endswith((".o", ".so")):
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem
            pass
    shutil.copy2(src, dst)


def stale_locks(ext_dir: Path, older_than: float | None = None, op: str = "*") -> list[Path]:
    """The ops' lock files in ``ext_dir`` (modified before ``older_than``, a ``time.time()``, if
    given; of the op named ``op`` only, if given)."""
    found = []
    for lock in sorted(Path(ext_dir).glob(f"{op}/{LOCK_FILE}")):
        try:
            if older_than is None or lock.stat().st_mtime < older_than:
                found.append(lock)
        except OSError:
            pass
    return found


def remove_stale_locks(ext_dir: Path) -> list[Path]:
    """Remove every op lock in ``ext_dir``; call only while no process may load from it (no
    experiment of this tuner runs, and orphans of an earlier one are reaped). Returns those removed."""
    removed = []
    for lock in stale_locks(ext_dir):
        try:
            lock.unlink()
            removed.append(lock)
        except OSError:
            pass
    return removed
