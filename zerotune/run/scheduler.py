"""The experiment scheduler: where and when experiments run, and that every result is kept.

A FIFO queue: the head waits until its slots can be reserved (atomically, from the
``SlotPool``); one thread per running experiment; several run at once when slots allow. Results
live on disk (``exp.json`` per experiment, :func:`zerotune.run.expdir.write_record`): an
experiment whose OK or OOM result is on disk under the same resume key (the config content and
the job's script, arguments, layout, budget and measurement: :mod:`zerotune.run.resume`) is not
run again; a failed, timed-out or interrupted one, or one recorded under another key, is.
The scheduler never decides what to try next: the search hands it batches.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.deepspeed.extensions import extensions_dir, remove_stale_locks, seed, stale_locks
from zerotune.run.backends.base import Backend
from zerotune.run.expdir import load_record, not_own, write_record
from zerotune.run.resume import resume_key
from zerotune.run.slots import SlotPool

logger = logging.getLogger(__name__)


class DirLock:
    """An exclusive lock on a directory, so two tuners never share one: ``fcntl.flock`` on
    ``<dir>/.zerotune.lock`` (opened without following a symlink), which the kernel drops when its
    holder dies. A subclass names the directory and what to do instead.

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
    """The results dir's lock (:class:`DirLock`): one tuner writes its summary and answer."""

    what = "results dir"
    instead = "choose another --results-dir"


class ExpsLock(DirLock):
    """The exps dir's lock (:class:`DirLock`): one tuner runs, resumes and removes its experiments. Two
    configs that differ only in ``results_dir`` share the default ``autotuning_exps``."""

    what = "exps dir"
    instead = "give each tuning its own 'autotuning.exps_dir' (or --results-dir)"


@contextlib.contextmanager
def tuning_locks(results_dir: Path, exps_dir: Path) -> Iterator[None]:
    """What a tuning holds from start to end: its results dir's lock, then its exps dir's (one lock
    where they are the same directory).

    Raises:
        ConfigError: another tuner holds either; the results dir is tried first, so nothing is created
            under the exps dir when it is held.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(ResultsLock(results_dir))
        if Path(exps_dir).resolve() != Path(results_dir).resolve():
            stack.enter_context(ExpsLock(exps_dir))
        yield


_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def experiment_dir(exps_dir: Path, name: str) -> Path:
    """The directory of experiment ``name``: a direct child of ``exps_dir``, checked on the resolved
    path (a name with a separator or ``..``, or a symlink out of the exps dir, is refused), and never a
    symlink, even to a directory inside the exps dir (zerotune would write its record into the
    target, and remove it on ``--overwrite``), so that nothing is created or removed outside the
    results tree or through a link, whatever a config's keys say.

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


def clear_experiments(exps_dir: Path) -> list[str]:
    """``--overwrite``: remove the experiment directories in ``exps_dir``, those zerotune can prove its
    own by their record's content (:func:`~zerotune.run.expdir.not_own`: a real directory whose
    ``exp.json`` is zerotune's record of it), nothing else: a config's ``exps_dir`` may name any
    directory, and a user's ``exp.json`` beside their checkpoint stays. Returns the names removed."""
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


def make_way(exp_dir: Path) -> None:
    """Make way for a fresh run in ``exp_dir`` (checked by :func:`experiment_dir`): zerotune's own earlier
    attempt there (interrupted, failed, under another key, or its record not trusted) is removed, an
    empty directory too; anything else (a user's directory, DeepSpeed's autotuner's, an ``exp.json``
    that is not zerotune's record) is moved aside whole, to ``<name>.kept-<n>``, and said in the log."""
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


class Scheduler:
    """Runs batches of experiments on a slot pool through a backend.

    Args:
        backend: runs one experiment (thread-safe).
        pool: the device slots.
        exps_dir: one sub-directory per experiment, named after it.
        on_update: called (from any thread) as ``on_update(exp, event)`` for progress display
            (``zerotune.report.progress.Progress.update``), with ``event`` one of: ``"cached"`` (its
            reusable result came from disk), ``"queued"`` (waiting for slots), ``"start"``
            (launched), ``"end"`` (finished, ``exp.status`` set). Every queued experiment is
            started and ended, except after an interrupt.
        context: what besides the config makes two experiments the same
            (:func:`zerotune.run.resume.resume_context`); recorded with every result and part of
            its resume key. None: ``{}`` (a scheduler built by hand, in tests).

    .. note:: Every experiment directory is checked to be a direct child of ``exps_dir`` on its
       resolved path (:func:`experiment_dir`) before anything is read, created or removed; a batch
       with a name that fails is refused whole (ConfigError) before any of it launches.
    """

    def __init__(self, backend: Backend, pool: SlotPool, exps_dir: Path,
                 on_update: Callable[[Experiment, str], None] | None = None, context: dict | None = None):
        self.backend = backend
        self.pool = pool
        self.exps_dir = Path(exps_dir)
        self.on_update = on_update or (lambda exp, event: None)
        self.context = context or {}
        self._seeded = False
        self.history: list[Experiment] = []
        self.launched = 0
        self._cond = threading.Condition()

    def load(self, exp: Experiment) -> Experiment | None:
        """The reusable result on disk for ``exp``'s name and resume key (OK or OOM), if any
        (:func:`zerotune.run.expdir.load_record`)."""
        return load_record(experiment_dir(self.exps_dir, exp.name), exp.ds_config, self._key(exp))

    def _key(self, exp: Experiment) -> str:
        return resume_key(exp.ds_config, self.context)

    def _record(self, exp: Experiment, exp_dir: Path) -> None:
        write_record(exp, exp_dir, self._key(exp), self.context)

    def run(self, experiments: Iterable[Experiment]) -> list[Experiment]:
        """Run a batch and return it in the same order, each with its outcome.

        Experiments with a reusable result on disk (:meth:`load`) are returned from disk without
        running. On
        KeyboardInterrupt the running ones are killed, recorded as interrupted, and the
        interrupt is re-raised.
        """
        batch = list(experiments)
        for exp in batch:
            experiment_dir(self.exps_dir, exp.name)  # every name checked before anything runs
        if not self._seeded:  # the experiments' own extension cache (zerotune.deepspeed.extensions)
            seed(extensions_dir(self.exps_dir))
            self._seeded = True
        queue: collections.deque[Experiment] = collections.deque()
        results: dict[int, Experiment] = {}
        for i, exp in enumerate(batch):
            done = self.load(exp)
            if done is not None:
                done.space = exp.space or done.space
                results[i] = done
                self.history.append(done)
                self.on_update(done, "cached")
            else:
                if not self.pool.can_ever_fit(exp.num_nodes, exp.num_slots):
                    raise ConfigError(f"experiment {exp.name} needs {exp.num_nodes} node(s) x {exp.num_slots} "
                                      f"slot(s); the selected resources have {self.pool.total_slots} slot(s)")
                queue.append(exp)
        for exp in queue:
            self.on_update(exp, "queued")
        index = {id(e): i for i, e in enumerate(batch)}
        threads: list[threading.Thread] = []
        cached = len(results)
        try:
            while True:
                with self._cond:
                    # results[i] is set (under this lock) as an experiment ends; counting them, not
                    # live threads, means no extra wait for a thread still inside on_update("end").
                    running = len(threads) - (len(results) - cached)
                    if not queue and not running:
                        break
                    reservation = self.pool.try_reserve(queue[0].num_nodes, queue[0].num_slots) if queue else None
                    if reservation is None:
                        self._cond.wait(timeout=0.5)
                        continue
                    exp = queue.popleft()
                    if not running:  # no experiment of this tuner loads ops now: a lock is a killed one's
                        for lock in remove_stale_locks(extensions_dir(self.exps_dir)):
                            logger.info(f"removed {lock}: a torch extension lock left by a killed process")
                t = threading.Thread(target=self._run_one, args=(exp, reservation, results, index[id(exp)]),
                                     name=f"exp-{exp.name}", daemon=True)
                threads.append(t)
                t.start()
        except KeyboardInterrupt:
            self.backend.cancel_all()
            for t in threads:
                t.join()
            raise
        for t in threads:
            t.join()
        return [results[i] for i in range(len(batch))]

    def _run_one(self, exp: Experiment, reservation, results: dict, i: int) -> None:
        exp_dir = self.exps_dir / exp.name
        started = time.time()
        try:
            exp_dir = experiment_dir(self.exps_dir, exp.name)
            make_way(exp_dir)  # an attempt not reused; never what zerotune cannot prove its own
            exp_dir.mkdir(parents=True)
            exp.status = Status.INTERRUPTED  # what exp.json says if the tuner dies while this runs
            exp.started_at = started
            self._record(exp, exp_dir)
            with self._cond:
                self.launched += 1
            self.on_update(exp, "start")
            self.backend.run(exp, reservation, exp_dir)
            if exp.status is Status.TIMEOUT:
                locks = stale_locks(extensions_dir(self.exps_dir), older_than=started)
                if locks:
                    exp.error = (f"{exp.error}; {', '.join(map(str, locks))} was there before it started: a torch "
                                 f"extension lock left by a killed process, which DeepSpeed's op loader waits on "
                                 f"(removed before the next experiment when none runs)")
        except Exception as e:  # a backend (or disk) error must not kill the tuner or lose other results
            exp.status, exp.error = Status.FAILED, f"backend error: {e!r}"
        finally:
            try:
                self._record(exp, exp_dir)
            except OSError:
                pass  # the result is still returned; only its record on disk is missing
            with self._cond:
                self.pool.release(reservation)
                results[i] = exp
                self.history.append(exp)
                self._cond.notify_all()
            self.on_update(exp, "end")
