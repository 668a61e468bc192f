"""What a warm rank server imports before it forks ranks: torch, DeepSpeed and the script's own top-level imports.

The script's ``import`` statements are read from its AST, never run: the module's own statements and those nested
in its top-level ``if``/``try``/``with`` blocks (a function's or a class's imports run later, if at all). Only modules
of installed distributions are imported (:func:`importlib.metadata.packages_distributions`), never a module of the
script's own directory (it may change between experiments, and importing it would run the user's code in the
server), nor the standard library (cheap to import in the rank). ``from X import Y`` also fetches ``Y``, since
packages such as transformers load a model's module only when its name is first asked for (GPT-2's: 1.7 s of a
3.6 s preload, D304). A failing import is logged and skipped: the rank imports it again and meets the error as
the script's own.

The preload must leave the server fork-safe: no thread started (OpenMP's pool, a library's background thread), no
CUDA context (a CUDA context does not survive ``fork``; DeepSpeed's import asks ``torch.cuda`` questions that
initialize it unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which the server sets). :func:`fork_unsafe` says what
broke it; the server then launches nothing warm.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ALWAYS", "Preloaded", "fork_unsafe", "preload", "script_imports"]

log = logging.getLogger(__name__)

ALWAYS = ("torch", "deepspeed", "deepspeed.runtime.engine")
"""Imported first in every server: what every rank of a DeepSpeed script imports (the engine module is the one
the probe wraps)."""


def script_imports(script: str | os.PathLike) -> list[tuple[str, tuple[str, ...]]]:
    """The absolute imports at the top level of ``script``, in order, each once: ``(module, names)``, where
    ``names`` are the names of a ``from module import ...`` (empty for ``import module``; ``*`` is left out).

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


def _installed(top: str, script_dir: Path) -> bool:
    """Whether top-level module ``top`` belongs to an installed distribution and is not shadowed by a module of the
    script's own directory."""
    if (script_dir / f"{top}.py").exists() or (script_dir / top).is_dir():
        return False
    return top in importlib.metadata.packages_distributions()


@dataclass
class Preloaded:
    """What :func:`preload` imported (module names, in order) and what it skipped (module -> why)."""

    imported: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def preload(script: str | os.PathLike) -> Preloaded:
    """Import :data:`ALWAYS`, then the installed modules ``script`` imports at top level (:func:`script_imports`),
    into this process. Never raises for an import: a failure is logged and recorded in :attr:`Preloaded.skipped`;
    a script that cannot be read or parsed preloads :data:`ALWAYS` alone."""
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


def fork_unsafe() -> str | None:
    """Why forking this process now would be unsafe (a thread besides the main one, a CUDA context), or None."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        import threading
        threads = threading.active_count()
    if threads > 1:
        return f"{threads} threads are running after the preload (a fork copies only the calling one)"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA was initialized by the preload (a CUDA context does not survive fork)"
    return None
