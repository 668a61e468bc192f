"""A tuning's lifetime on its directories, the private machinery under `zerotune.autotuner.Autotuner` (signals,
locks, orphans, ``--overwrite``, the torch extension cache), and ``zerotune run``'s training, which never outlives
zerotune.
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
    """The tuner was stopped by signal ``signum``; a KeyboardInterrupt, so every Ctrl-C cleanup path runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def tuning_lifetime(results_dir: Path, exps_dir: Path, overwrite: bool) -> Iterator[None]:
    """Within it a tuning owns its directories: stop signals raise `Interrupted`, both dirs are locked, a killed
    tuner's runs are stopped before anything is deleted or trusted, ``overwrite`` removes zerotune's experiment dirs
    and the summary, and the extension cache is prepared.

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
    """While tuning, a stop signal raises `Interrupted` in the main thread (running experiments are killed and
    recorded as interrupted); later ones are ignored so the bounded cleanup is never cut short. Off the main thread
    nothing changes."""
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
    """While the results are written, a stop signal waits until they are whole, then is handled as it would have
    been, so a signal never leaves a new config beside an old summary. Off the main thread nothing changes."""
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
    """Create the experiments' torch extension cache (`zerotune.deepspeed.extensions`), seeded from the ops this
    install built and cleared of locks (orphans are reaped by now); log the machine cache's ops the experiments
    will rebuild and its stale locks.

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
    """After a completed tuning, add the ops its experiments built to zerotune's cache (built once per install)."""
    extensions.publish(extensions.extensions_dir(exps_dir))


def build_note(exps_dir: Path, since: float | None) -> str | None:
    """The summary's line on the torch extensions built since ``since`` (epoch seconds; None: not started)."""
    return None if since is None else extensions.build_note(
        extensions.builds_since(extensions.extensions_dir(exps_dir), since))


def run_training(cmd: Sequence[str], env: Mapping[str, str], master_port: int) -> int:
    """Run the training launcher ``cmd`` in a session of its own with ``env`` added; returns its exit status
    (negative: killed by that signal). A stop signal becomes SIGTERM to the launcher, whose process group is killed
    after 30 s, then `Interrupted` is raised. The run's shared-memory files are removed however it ends."""

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
