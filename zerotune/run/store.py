"""What zerotune keeps on disk, kept safe: files written whole, directories held by one tuner, and experiment
directories proven its own.

Files are written whole (`write_text_atomic`), never through a symlink. One tuner holds a results dir and an exps
dir (`tuning_locks`), released by the kernel when it dies. An experiment's directory is a direct child of the exps
dir, never a symlink (`experiment_dir`); zerotune removes only one whose ``exp.json`` is its record of it and moves
anything else aside whole (`make_way`). The record's schema is `zerotune.run.exprecord`'s.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from zerotune.core.errors import ConfigError

__all__ = [
    "DirLock", "ExpsLock", "RECORD_FILE", "ResultsLock", "clear_experiments", "experiment_dir", "make_way", "not_own",
    "read_json", "read_object", "tuning_locks", "write_json_atomic", "write_text_atomic",
]

logger = logging.getLogger(__name__)

RECORD_FILE = "exp.json"  # an experiment's record (`zerotune.run.exprecord`)


# --- files written whole, JSON read within reason -------------------------------------------------------------------

def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, whole or not at all (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (temp file beside it, fsync, rename): a reader, a crash or a
    signal sees the old file or the new one. A symlink at ``path`` is replaced, never written through; whatever
    stops the write, the temp file is removed and the old file stays."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # one a killed process of the same pid left
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def open_log(path: Path, append: bool = True) -> BinaryIO:
    """A log file opened for binary writing (``append``, else emptied); a symlink at ``path`` is replaced, never
    written through.

    Raises:
        OSError: it cannot be opened.
    """
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    return open(os.open(path, flags, 0o644), "ab" if append else "wb")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file's content; None when the file is missing, unreadable or not an object."""
    return read_object(Path(path))[0]


def read_object(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A JSON object file's content and why it has none: (content, ''); (None, '') when the file is missing;
    (None, why) when it cannot be read or is not a JSON object."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"cannot be read ({e})"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        return None, f"not JSON ({str(e) or 'nested too deep'})"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    return data, ""


# --- one tuner per directory ------------------------------------------------------------------------------------------

class DirLock:
    """An exclusive lock on a directory, so two tuners never share one: ``fcntl.flock`` on ``<dir>/.zerotune.lock``,
    which the kernel drops when its holder dies. A subclass names the directory and what to do instead.

    Raises:
        ConfigError: another process holds the lock (its pid is named), or the lock file cannot be made.
    """

    what = "directory"
    instead = "choose another one"

    def __init__(self, directory: Path):
        self.path = Path(directory) / ".zerotune.lock"
        self._fd: int | None = None

    def __enter__(self) -> "DirLock":
        where = self.path.parent.absolute()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ConfigError(f"{self.what} {where}: cannot create it or its lock file: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"{self.what} {where} is in use by another zerotune (pid {holder}); "
                              f"wait for it or {self.instead}") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as e:  # a full disk
            os.close(fd)
            raise ConfigError(f"{self.what} {where}: cannot write its lock file: {e.strerror or e}") from None
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class ResultsLock(DirLock):
    """The results dir's lock: one tuner writes its summary and answer."""

    what = "results dir"
    instead = "choose another --results-dir"


class ExpsLock(DirLock):
    """The exps dir's lock: one tuner runs, resumes and removes its experiments (configs that differ only in
    ``results_dir`` share the default ``autotuning_exps``)."""

    what = "exps dir"
    instead = "give each tuning its own 'autotuning.exps_dir' (or --results-dir)"


@contextlib.contextmanager
def tuning_locks(results_dir: Path, exps_dir: Path) -> Iterator[None]:
    """What a tuning holds from start to end: its results dir's lock, then its exps dir's (one if they are the same).

    Raises:
        ConfigError: another tuner holds either (when the results dir is held, nothing is created under the exps dir).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(ResultsLock(results_dir))
        if Path(exps_dir).resolve() != Path(results_dir).resolve():
            stack.enter_context(ExpsLock(exps_dir))
        yield


# --- experiment directories: inside the exps dir, removed only when proven zerotune's -------------------------------

_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def experiment_dir(exps_dir: Path, name: str) -> Path:
    """The directory of experiment ``name``: a direct child of ``exps_dir`` on the resolved path, and never a symlink,
    even within the exps dir, so nothing is created or removed outside the results tree or through a link.

    Raises:
        ConfigError: ``name`` is not ``[A-Za-z0-9_-][A-Za-z0-9._-]*`` (200 characters at most), or its
            directory resolves outside ``exps_dir``, or is a symlink.
    """
    if not _SAFE_NAME.fullmatch(name):
        raise ConfigError(f"experiment name {name!r}: expected letters, digits, '.', '_' and '-' (not starting "
                          f"with '.'), at most 200 characters")
    path = Path(exps_dir) / name
    if path.resolve().parent != Path(exps_dir).resolve():
        raise ConfigError(f"experiment directory {path} resolves to {path.resolve()}, outside the exps dir "
                          f"{Path(exps_dir).resolve()}: zerotune creates and removes directories only inside it")
    if path.is_symlink():
        raise ConfigError(f"experiment directory {path} is a symlink (to {os.readlink(path)}): zerotune never writes "
                          f"or removes through one; move it away or choose another exps dir")
    return path


def not_own(exp_dir: Path) -> str:
    """Why ``exp_dir`` cannot be proven an experiment directory zerotune made ('' when it can).

    zerotune's own is a real directory holding a regular ``exp.json`` whose ``name`` is the directory's and which
    carries a ``config_digest`` (every zerotune writes one); a user's or DeepSpeed's ``exp.json`` is not. Only such a
    directory is removed (`clear_experiments`, `make_way`), even when its record does not verify.
    """
    exp_dir, path = Path(exp_dir), Path(exp_dir) / RECORD_FILE
    if exp_dir.is_symlink() or not exp_dir.is_dir():
        return "a symlink" if exp_dir.is_symlink() else "not a directory"
    if path.is_symlink() or not path.is_file():
        return f"no {RECORD_FILE}" if not os.path.lexists(path) else f"its {RECORD_FILE} is not a regular file"
    data, why = read_object(path)
    if data is None:
        return f"its {RECORD_FILE} is {why}"
    digest = data.get("config_digest")
    if data.get("name") != exp_dir.name or not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{12}", digest)):
        return f"its {RECORD_FILE} is not a zerotune record of experiment {exp_dir.name!r}"
    return ""


def make_way(exp_dir: Path) -> None:
    """Make way for a fresh run in ``exp_dir`` (checked by `experiment_dir`): zerotune's own earlier attempt
    (`not_own`) or an empty directory is removed; anything else is moved aside whole to ``<name>.kept-<n>``,
    with a warning."""
    if not os.path.lexists(exp_dir):
        return
    why = not_own(exp_dir)
    if not why:
        shutil.rmtree(exp_dir)
    elif exp_dir.is_dir() and not exp_dir.is_symlink() and not any(exp_dir.iterdir()):
        exp_dir.rmdir()
    else:
        n = 1
        while os.path.lexists(aside := exp_dir.with_name(f"{exp_dir.name}.kept-{n}")):
            n += 1
        os.rename(exp_dir, aside)
        logger.warning(f"{exp_dir}: {why}, so it is not zerotune's: moved to {aside.name}, whole, and the "
                       f"experiment runs afresh")


def clear_experiments(exps_dir: Path) -> list[str]:
    """``--overwrite``: remove the experiment directories in ``exps_dir`` that zerotune can prove its own
    (`not_own`), nothing else (``exps_dir`` may name any directory); returns the names removed."""

    removed = []
    try:
        children = sorted(Path(exps_dir).iterdir())
    except OSError:
        return removed
    for child in children:
        if _SAFE_NAME.fullmatch(child.name) and not not_own(child):
            shutil.rmtree(experiment_dir(exps_dir, child.name))
            removed.append(child.name)
    return removed
