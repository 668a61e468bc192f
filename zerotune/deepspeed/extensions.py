"""DeepSpeed's JIT-built ops and the torch extension cache the experiments load them from (D317).

A process loading a JIT-built op waits without a timeout on its ``<op>/lock`` (torch's ``FileBaton``), so a rank
killed holding it would hang every later run. Hence experiments never use the machine's cache: each exps dir has its
own (`extensions_dir`), seeded (`seed`) with copies, never hard links, of the ops this install built (`built_here`)
that load with no build (`would_build`); ops the experiments built are kept in zerotune's cache (`publish`). A lock
left in an exps dir's cache while none of its experiments runs is removed (`remove_stale_locks`), and a run that
timed out names one older than itself (`stale_locks`).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["EXTENSIONS_DIR", "LOCK_FILE", "build_note", "builds_since", "built_here", "default_root", "extensions_dir", "own_root", "publish",
           "remove_stale_locks", "seed", "stale_locks", "would_build"]

EXTENSIONS_DIR = ".torch_extensions"  # under the exps dir
LOCK_FILE = "lock"  # torch.utils.file_baton.FileBaton's file in each op's build directory
BUILD_S = 600.0  # a lock younger than this in the machine's cache may be a build in progress
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), clone a whole file (a reflink)


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
    from torch.utils.cpp_extension import get_default_build_root
    return Path(get_default_build_root()) / _build_tag()


def _build_tag() -> str:
    """``py<ver>_<cpu|cuXY|rocmXY>``: the per-interpreter, per-accelerator subdirectory torch uses."""
    import torch
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"


def own_root(environ: dict[str, str] | None = None) -> Path:
    """zerotune's own cache of ops its experiments built (`publish`):
    ``$XDG_CACHE_HOME/zerotune/torch_extensions/<py>_<accelerator>`` (default ``~/.cache``)."""
    env = os.environ if environ is None else environ
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "zerotune" / "torch_extensions" / _build_tag()


@functools.lru_cache(maxsize=None)
def _install_dirs() -> tuple[str, str | None]:
    """This interpreter's torch and DeepSpeed package dirs (None: not installed), found without importing DeepSpeed."""
    import torch
    spec = importlib.util.find_spec("deepspeed")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.dirname(torch.__file__), (locations[0] if locations else None)


def built_here(op: Path, install: tuple[str, str | None] | None = None) -> bool:
    """Whether the op built in ``op`` was built by this install (``install``: the torch and DeepSpeed package dirs,
    default this interpreter's): it has a library and a ``build.ninja`` naming this torch's include dir and, for a
    DeepSpeed op (sources under ``deepspeed/ops``), this DeepSpeed's ``ops`` dir."""
    torch_dir, deepspeed_dir = install or _install_dirs()
    try:
        ninja = (Path(op) / "build.ninja").read_text(errors="replace")
    except OSError:
        return False
    if not any(Path(op).glob("*.so")) or not _names(ninja, os.path.join(torch_dir, "include")):
        return False
    if f"deepspeed{os.sep}ops{os.sep}" in ninja:
        return deepspeed_dir is not None and _names(ninja, os.path.join(deepspeed_dir, "ops"))
    return True


def _names(ninja: str, path: str) -> bool:
    """Whether ``build.ninja``'s text names ``path`` or a path under it, as a whole path: after a space,
    ``=``, ``-I`` or ``-L`` (not inside a longer path that ends the same)."""
    return re.search(r"(?:^|[\s=]|-[IL])" + re.escape(path) + r"(?:[/\s]|$)", ninja, re.MULTILINE) is not None


def seed(target: Path, sources: Sequence[Path] | None = None,
         install: tuple[str, str | None] | None = None) -> list[str]:
    """Copy into ``target`` each op it lacks from the first of ``sources`` (default: `default_root`, then `own_root`)
    that built it with this install (`built_here`), with its timestamps and no lock, unless that source is building it
    now (a lock younger than ``BUILD_S``) or the copy would build (`would_build`); return the ops copied."""
    sources = [default_root(), own_root()] if sources is None else [Path(s) for s in sources]
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for source in sources:
        try:
            ops = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            continue
        for op in ops:
            if (target / op.name).exists() or stale_locks(op.parent, time.time() - BUILD_S, op.name) != \
                    stale_locks(op.parent, None, op.name) or not built_here(op, install):
                continue
            if _copy_whole(op, target / op.name):
                if would_build(target / op.name):  # torch would run ninja on load: left to the experiments
                    shutil.rmtree(target / op.name, ignore_errors=True)
                    continue
                copied.append(op.name)
    return copied


def would_build(op: Path, environ: dict[str, str] | None = None) -> str:
    """Why loading the op built in ``op`` would build (ninja's first reason, e.g. ``command line not found in log
    for fused_adam.o``), or '' when it would not: ninja's own dry run (``ninja -n -d explain``) in ``op``, with the
    ``ninja`` first on ``environ``'s ``PATH`` as torch runs it. Run only in zerotune's caches: ninja rewrites a log
    another version wrote."""
    env = os.environ if environ is None else environ
    ninja = shutil.which("ninja", path=env.get("PATH"))
    if ninja is None:
        return "no ninja on PATH"
    try:
        out = subprocess.run([ninja, "-n", "-d", "explain"], cwd=op, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ninja's dry run failed: {e}"
    if out.returncode == 0 and "no work to do" in out.stdout:
        return ""
    lines = [ln.removeprefix("ninja explain: ") for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
    return lines[0] if lines else f"ninja's dry run exited {out.returncode}"


def publish(ext_dir: Path, own: Path | None = None, machine: Path | None = None,
            install: tuple[str, str | None] | None = None) -> list[str]:
    """Keep in zerotune's cache (``own``, default `own_root`) each op in ``ext_dir`` that this install built
    (`built_here`), has no lock, is not held there as built here, and is not the machine's library seeded (``machine``,
    default `default_root`: the same ``<op>.so`` size and mtime); return the ops kept. Call only while no experiment
    may build in ``ext_dir``; a failure (a full disk, a read-only home) keeps nothing and raises nothing."""
    own = own_root() if own is None else Path(own)
    machine = default_root() if machine is None else Path(machine)
    kept = []
    try:
        ops = sorted(p for p in Path(ext_dir).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return kept
    for op in ops:
        if (op / LOCK_FILE).exists() or not built_here(op, install) or built_here(own / op.name, install) \
                or _same_library(op, machine / op.name):
            continue
        old = own / f".{op.name}.old"
        try:
            own.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(old, ignore_errors=True)
            if (own / op.name).exists():
                (own / op.name).rename(old)  # another install's build: replaced whole
            if _copy_whole(op, own / op.name):
                kept.append(op.name)
        except OSError:
            pass
        shutil.rmtree(old, ignore_errors=True)
    return kept


def _same_library(op: Path, other: Path) -> bool:
    """Whether ``op``'s ``<op>.so`` is ``other``'s as seeding copies it (the same size and mtime)."""
    try:
        mine, theirs = (op / f"{op.name}.so").stat(), (other / f"{op.name}.so").stat()
    except OSError:
        return False
    return (mine.st_size, mine.st_mtime_ns) == (theirs.st_size, theirs.st_mtime_ns)


def builds_since(ext_dir: Path, since: float) -> dict[str, float]:
    """The ops whose ``<op>.so`` in ``ext_dir`` was written since ``since`` (seconds since the epoch), each with its
    last build's time, s (`last_build_s`); one without a ``.so`` or a ninja log line for it is left out."""
    builds = {}
    try:
        ops = sorted(p for p in Path(ext_dir).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return builds
    for op in ops:
        try:
            written = (op / f"{op.name}.so").stat().st_mtime
        except OSError:
            continue
        took = last_build_s(op / ".ninja_log", f"{op.name}.so") if written >= since else None
        if took is not None:
            builds[op.name] = took
    return builds


def last_build_s(log: Path, output: str) -> float | None:
    """How long ninja's last run that wrote ``output`` (the library, linked last) took, s: the end, in ms from that
    run's start, of its last line in the build dir's ``.ninja_log``. None: no log, or no such line."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        fields = line.split("\t")
        if len(fields) >= 4 and fields[3] == output and fields[1].isdigit():
            return int(fields[1]) / 1000
    return None


def build_note(builds: dict[str, float]) -> str | None:
    """The summary's line on the JIT builds a tuning paid (`builds_since`), e.g. ``JIT builds paid by this
    tuning: cpu_adam 61 s (kept in zerotune's cache: ...)``; None when there were none."""
    if not builds:
        return None
    return ("JIT builds paid by this tuning: " + ", ".join(f"{op} {s:.0f} s" for op, s in sorted(builds.items()))
            + " (kept in zerotune's cache: the next tuning loads them)")


def _copy_whole(op: Path, dest: Path) -> bool:
    """Copy the build dir ``op`` to ``dest`` whole or not at all (a partial copy, then a rename), no lock."""
    partial = dest.parent / f".{dest.name}.copying"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(op, partial, ignore=shutil.ignore_patterns(LOCK_FILE), symlinks=True,
                        copy_function=_copy_file)
        partial.rename(dest)
        return True
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        return False


def _copy_file(src: str, dst: str) -> None:
    """Copy one file of a build dir with its mode and timestamps into a new inode of its own: a reflink where the
    filesystem has one, else the bytes; never a hard link, through which a rebuild would rewrite every other cache."""
    if _reflink(src, dst):
        shutil.copystat(src, dst)
    else:
        shutil.copy2(src, dst)


def _reflink(src: str, dst: str) -> bool:
    """Whether ``dst`` was made a reflink of ``src`` (Linux's ``FICLONE``); False where the filesystem or
    the platform has none (``dst`` may then exist, empty)."""
    if not sys.platform.startswith("linux"):
        return False
    import fcntl
    try:
        with open(src, "rb") as source, open(dst, "wb") as dest:
            fcntl.ioctl(dest.fileno(), FICLONE, source.fileno())
        return True
    except OSError:
        return False


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
