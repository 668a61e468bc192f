"""A tuning's lifetime on its directories, the private machinery under `zerotune.autotuner.Autotuner`: stop
signals raise `Interrupted` (and wait while results are written), both directories are locked, orphans a
killed tuner left are reaped, ``--overwrite`` clears zerotune's experiment dirs, and the experiments' torch extension
cache is prepared before the first launch and published after the last; and ``zerotune run``'s training, which never
outlives zerotune.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from zerotune.core.errors import ConfigError
from zerotune.deepspeed import extensions
from zerotune.run.processes import RUNNING_DIR, reap_orphans, remove_shm_buffers
from zerotune.run.store import clear_experiments, tuning_locks

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What Ctrl-C, Slurm's scancel, ``docker stop``, ``timeout``, Kubernetes and a closed terminal send."""


class Interrupted(KeyboardInterrupt):
    """The tuner was stopped by a signal (`STOP_SIGNALS`); ``signum`` says which. A
    KeyboardInterrupt, so every path that cleans up after Ctrl-C cleans up after it too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def tuning_lifetime(results_dir: Path, exps_dir: Path, overwrite: bool) -> Iterator[None]:
    """Within it a tuning owns its directories: stop signals raise `Interrupted` (`_signals_interrupt`),
    the results and exps dirs are locked (`zerotune.run.store.tuning_locks`), experiments a killed earlier
    tuner left running on this dir are stopped before anything is deleted or cached results are trusted, with
    ``overwrite`` zerotune's experiment dirs and the summary are removed, and the extension cache is prepared
    (`prepare_extensions`).

    Raises:
        ConfigError: a directory cannot be created or is in use by another tuner.
    """
    with _signals_interrupt(), tuning_locks(results_dir, exps_dir):
        reap_orphans(exps_dir / RUNNING_DIR)
        if overwrite:
            clear_experiments(exps_dir)  # zerotune's experiment dirs only, whatever exps_dir names
            (results_dir / "summary.txt").unlink(missing_ok=True)
        prepare_extensions(exps_dir)
        yield


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While tuning, SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread: the
    running experiments are killed (with every process) and recorded as interrupted, finished
    results are kept. Later signals while that cleanup runs are ignored, so it is never cut short
    (it is bounded: a process tree gets SIGTERM, then SIGKILL after 10 s). Off the main thread,
    where Python cannot install handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def handler(signum, frame):
        if not raised:
            raised.append(signum)
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While the results are written, a stop signal (`STOP_SIGNALS`) waits until they are whole,
    then is handled as it would have been (within `tuning_lifetime`: `Interrupted`,
    unless one is already in flight). So a signal leaves the old answer or the new one, never a new
    config beside an old summary. Off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if arrived:
            handler = previous[arrived[0]]
            if callable(handler):
                handler(arrived[0], None)
            else:
                signal.raise_signal(arrived[0])  # its default action, as if it arrived now


def prepare_extensions(exps_dir: Path) -> None:
    """The experiments' own torch extension cache (`zerotune.deepspeed.extensions`): created,
    seeded from the ops this install built (the machine's cache, then zerotune's own), cleared of
    locks (nothing of this tuner runs yet and orphans are reaped); an op the machine's cache holds
    from another install, which the experiments will build, and a stale lock there are said.

    Raises:
        ConfigError: the exps dir cannot be created.
    """
    try:
        exps_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"exps dir {exps_dir}: cannot create it: {e.strerror or e}") from None
    ext = extensions.extensions_dir(exps_dir)
    extensions.seed(ext)
    machine = extensions.default_root()
    for op in sorted(p.parent.name for p in machine.glob("*/build.ninja") if not (ext / p.parent.name).exists()):
        why = ("was built by another install (its build.ninja names other paths)"
               if not extensions.built_here(machine / op) else "would be rebuilt by its load (ninja's log or "
               "timestamps are not its build's)")
        logger.info(f"note: {machine / op} {why}: the experiments build it again, once (about a minute), and "
                    f"zerotune keeps that build")
    for lock in extensions.remove_stale_locks(ext):
        logger.info(f"removed {lock}: a torch extension lock left by a killed process")
    old = time.time() - extensions.BUILD_S
    for lock in extensions.stale_locks(extensions.default_root(), older_than=old):
        logger.warning(f"note: {lock} is older than {extensions.BUILD_S / 60:g} min: DeepSpeed runs outside zerotune "
                       f"that load this op wait on it forever; remove it if no build is running")


def publish_extensions(exps_dir: Path) -> None:
    """After a tuning that ran to its end: the ops its experiments built join zerotune's own cache, so they are
    built once per install, not per exps dir (`zerotune.deepspeed.extensions.publish`)."""
    extensions.publish(extensions.extensions_dir(exps_dir))


def build_note(exps_dir: Path, since: float | None) -> str | None:
    """The summary's line on the torch extensions this tuning's experiments built since ``since`` (seconds since the
    epoch; None: the tuning has not started): `zerotune.deepspeed.extensions.build_note`."""
    return None if since is None else extensions.build_note(
        extensions.builds_since(extensions.extensions_dir(exps_dir), since))


def run_training(cmd: Sequence[str], env: Mapping[str, str], master_port: int) -> int:
    """Run the training command ``cmd`` (its launcher, in a session of its own) with ``env`` over the environment; its
    exit status (negative: killed by that signal). A stop signal (`STOP_SIGNALS`) is passed on to the launcher
    as SIGTERM (DeepSpeed's launcher then stops its ranks), which gets 30 s before its process group is killed; then
    `Interrupted` is raised. The shared-memory files DeepSpeed's CPU communication leaves for
    ``master_port`` are removed however it ends (`zerotune.run.processes.remove_shm_buffers`)."""
    with _signals_interrupt():
        proc = subprocess.Popen(list(cmd), env={**os.environ, **env}, start_new_session=True)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            remove_shm_buffers(master_port)
