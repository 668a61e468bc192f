"""What a warm rank server imports before it forks ranks: torch, DeepSpeed and the script's own top-level imports.

- The script's imports are read from its AST, never run (`script_imports`); `preload` imports those of installed
  distributions only, never a module of the script's own directory nor the standard library. A failing import is
  skipped: the rank imports it again and meets the error as the script's own.
- DeepSpeed's JIT ops already built in the exps dir's extension cache are loaded too, never built (`preload_ops`).
- The preload must leave the server fork-safe (no Python thread, no CUDA context): `fork_unsafe` says what broke it,
  and the server then launches nothing warm. `watch_parent` ends the server if its tuner dies while it preloads.
See D303.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from zerotune.deepspeed.extensions import EXTENSIONS_DIR, LOCK_FILE, would_build

__all__ = ["ALWAYS", "OPS", "Preloaded", "fork_unsafe", "learn", "learnable", "preload", "preload_ops", "watch_parent",
           "script_imports"]

log = logging.getLogger(__name__)

ALWAYS = ("torch", "deepspeed", "deepspeed.runtime.engine")
"""Imported first in every server: what every rank of a DeepSpeed script imports (the engine module is the one
the probe wraps)."""


def script_imports(script: str | os.PathLike) -> list[tuple[str, tuple[str, ...]]]:
    """The absolute top-level imports of ``script``, in order, each once: ``(module, names)``, ``names`` those of a
    ``from module import ...`` (``*`` left out). Top level includes nested ``if``/``try``/``with`` blocks, not
    functions or classes.

    Raises:
        OSError: the script cannot be read.
        SyntaxError: it is not Python.
    """
    tree = ast.parse(Path(script).read_bytes(), filename=str(script))
    found: dict[str, list[str]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, [])
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = found.setdefault(node.module, [])
                names += [a.name for a in node.names if a.name != "*" and a.name not in names]
            elif isinstance(node, (ast.If, ast.Try, ast.With)) or type(node).__name__ == "TryStar":
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, None) or [])
                for handler in getattr(node, "handlers", None) or []:
                    visit(handler.body)
    visit(tree.body)
    return [(module, tuple(names)) for module, names in found.items()]


@functools.lru_cache(maxsize=None)
def _distributions() -> frozenset[str]:
    """The top-level module names of the installed distributions (scanned once)."""
    return frozenset(importlib.metadata.packages_distributions())


@functools.lru_cache(maxsize=4096)
def _installed(top: str, script_dir: Path) -> bool:
    """Whether top-level module ``top`` belongs to an installed distribution and is not shadowed by a module of the
    script's own directory."""
    if (script_dir / f"{top}.py").exists() or (script_dir / top).is_dir():
        return False
    return top in _distributions()


@dataclass
class Preloaded:
    """What `preload` imported (module names, in order) and what it skipped (module -> why)."""

    imported: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def preload(script: str | os.PathLike) -> Preloaded:
    """Import `ALWAYS`, then the installed modules ``script`` imports at top level, into this process; never one of
    the script's directory (it may change between experiments, and would run user code in the server).
    ``from X import Y`` also fetches ``Y`` (lazy packages such as transformers load a module on first access).
    Never raises for an import: a failure is logged into `Preloaded.skipped`; an unreadable script preloads
    `ALWAYS` alone."""
    done = Preloaded()
    script_dir = Path(script).resolve().parent
    try:
        wanted = [(m, ()) for m in ALWAYS] + script_imports(script)
    except (OSError, SyntaxError, ValueError) as e:
        log.warning("warm server: the script's imports were not read (%s: %s): torch and deepspeed only",
                    type(e).__name__, e)
        wanted = [(m, ()) for m in ALWAYS]
    for module, names in wanted:
        top = module.partition(".")[0]
        if module in done.imported or module in done.skipped or top in sys.stdlib_module_names:
            continue
        if module not in ALWAYS and not _installed(top, script_dir):
            done.skipped[module] = "not an installed distribution's module"
            continue
        try:
            loaded = importlib.import_module(module)
            for name in names:
                getattr(loaded, name, None)  # a lazy package (transformers) loads the submodule here
        except BaseException as e:  # noqa: BLE001 - a broken import is the script's to meet, not the server's
            if isinstance(e, KeyboardInterrupt):
                raise
            done.skipped[module] = f"{type(e).__name__}: {e}"
            log.warning("warm server: preloading %s failed, skipped: %s: %s", module, type(e).__name__, e)
            continue
        done.imported.append(module)
    return done


def learnable(modules: list[str], script: str | os.PathLike) -> list[str]:
    """Of ``modules`` (those a warm rank imported after its fork), the ones `learn` may import: as for `preload`, and
    not yet imported here."""
    script_dir = Path(script).resolve().parent
    return [m for m in modules if isinstance(m, str) and m not in sys.modules
            and (top := m.partition(".")[0]) not in sys.stdlib_module_names and _installed(top, script_dir)]


def learn(modules: list[str]) -> tuple[list[str], str | None]:
    """Import ``modules`` (`learnable`: what a rank imports lazily after the script's top level) into this process,
    so the next forked ranks find them imported. A forked trial imports them first and says whether it stayed
    fork-safe; only then here. Returns the modules imported and, where nothing was, why (else None); a module that
    fails to import is left out."""
    if not modules:
        return [], None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the trial: import, then say whether forking would still be safe
        os.close(read)
        status = 1
        try:
            _import_all(modules)
            os.write(write, (fork_unsafe() or "").encode(errors="replace"))
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        unsafe = pipe.read().decode(errors="replace")
    _, wait_status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(wait_status) != 0:
        return [], "the trial import failed"
    if unsafe:
        return [], unsafe
    return _import_all(modules), None


def _import_all(modules: list[str]) -> list[str]:
    imported = []
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 - the rank imports it itself
            if isinstance(e, KeyboardInterrupt):
                raise
            continue
        imported.append(module)
    return imported


OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")
"""DeepSpeed's ops a rank loads most often (Adam and AdamW, offloaded Adam, CPU communication): each load of a JIT op
takes its build lock and checks the build, about 2 s for fused Adam on this 2-core machine, in every rank of every
cold launch."""


def preload_ops() -> list[str]:
    """Load the ops of `OPS` that load with no build from the exps dir's extension cache (``TORCH_EXTENSIONS_DIR``,
    `zerotune.deepspeed.extensions.would_build`), so forked ranks inherit them from ``OpBuilder._loaded_ops``. An op
    not built, one that would build, or one whose build dir holds torch's lock (the load would wait without end) is
    left to the rank: the server never compiles, and never loads from another cache (a load may rewrite it). CPU
    only: on CUDA a compatibility check may create the CUDA context. Returns the ops loaded; failures are logged."""
    loaded = []
    try:
        from deepspeed.accelerator import get_accelerator
        from torch.utils.cpp_extension import _get_build_directory
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.warning("warm server: no op preloaded: %s: %s", type(e).__name__, e)
        return loaded
    if get_accelerator()._name != "cpu" or Path(os.environ.get("TORCH_EXTENSIONS_DIR", "")).name != EXTENSIONS_DIR:
        return loaded  # a CUDA op's compatibility check may create the CUDA context; no cache of zerotune's
    for class_name in OPS:
        try:
            builder = get_accelerator().create_op_builder(class_name)
            if builder is None or not builder.is_compatible(verbose=False):
                continue
            build_dir = _get_build_directory(builder.name, verbose=False)
            if not os.path.exists(os.path.join(build_dir, f"{builder.name}.so")) or os.path.exists(
                    os.path.join(build_dir, LOCK_FILE)) or would_build(Path(build_dir)):
                continue  # torch's load waits, without end, on a lock a killed build left: the rank meets it
            builder.load(verbose=False)
        except BaseException as e:  # noqa: BLE001 - the rank loads it again and meets the error as its own
            if isinstance(e, KeyboardInterrupt):
                raise
            log.warning("warm server: loading op %s failed, skipped: %s: %s", class_name, type(e).__name__, e)
            continue
        loaded.append(builder.name)
    return loaded


def fork_unsafe() -> str | None:
    """Why forking this process now would be unsafe, or None: a Python thread besides the main one (its locks stay
    held in the child), or a CUDA context (it does not survive ``fork``; the server runs with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so DeepSpeed's import creates none). Native threads with ``pthread_atfork``
    handlers (OpenBLAS's) are no obstacle."""
    import threading
    if threading.active_count() > 1:
        return (f"{threading.active_count()} Python threads are running after the preload "
                f"({', '.join(t.name for t in threading.enumerate())}): a fork copies only the calling one")
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA was initialized by the preload (a CUDA context does not survive fork)"
    return None


PARENT_POLL_S = 0.2
"""How often the preload's watch looks for its parent, seconds."""


def watch_parent(parent: int):
    """Watch, from a thread, that ``parent`` stays this process's parent; once it does not, SIGKILL this process's
    group where it leads one (a warm server's builds die with it), else this process. Needed while a server preloads
    and nothing else would see its tuner die. Returns ``stop()``, which ends the watch and joins its thread."""

    done = threading.Event()

    def watch():
        while not done.wait(PARENT_POLL_S):
            if os.getppid() != parent:
                if os.getpgid(0) == os.getpid():
                    os.killpg(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="zerotune-parent-watch", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()
    return stop
