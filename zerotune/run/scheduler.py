"""The experiment scheduler: where and when experiments run, and that every result is kept.

A FIFO queue: the head waits until its slots can be reserved from the ``SlotPool``; one thread per running
experiment. Results live on disk (``exp.json``, `zerotune.run.exprecord`): an experiment whose OK or OOM result is
recorded under the same resume key (`zerotune.run.resume`) is not run again; any other is. The scheduler never
decides what to try next: the search hands it batches.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.deepspeed.extensions import extensions_dir, remove_stale_locks, seed, stale_locks
from zerotune.run.backends.base import Backend
from zerotune.run.exprecord import load_record, write_record
from zerotune.run.resume import resume_key
from zerotune.run.slots import SlotPool
from zerotune.run.store import experiment_dir, make_way

logger = logging.getLogger(__name__)


class Scheduler:
    """Runs batches of experiments on a slot pool through a backend.

    Args:
        backend: runs one experiment (thread-safe).
        exps_dir: one sub-directory per experiment, named after it (`zerotune.run.store.experiment_dir`).
        on_update: called from any thread as ``on_update(exp, event)``, ``event`` one of ``"cached"`` (result read
            from disk), ``"queued"``, ``"start"``, ``"end"`` (``exp.status`` set); every queued experiment is
            started and ended, except after an interrupt.
        context: what besides the config makes two experiments the same (`zerotune.run.resume.resume_context`);
            recorded with every result and part of its resume key. None: ``{}``.
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
        self.cached: set[str] = set()  # the names of the runs read back from disk, not launched
        self._cond = threading.Condition()

    def load(self, exp: Experiment) -> Experiment | None:
        """The reusable result on disk for ``exp``'s name and resume key, if any."""
        return load_record(experiment_dir(self.exps_dir, exp.name), exp.ds_config, self._key(exp))

    def _key(self, exp: Experiment) -> str:
        return resume_key(exp.ds_config, self.context)

    def _record(self, exp: Experiment, exp_dir: Path) -> None:
        write_record(exp, exp_dir, self._key(exp), self.context)

    def run(self, experiments: Iterable[Experiment]) -> list[Experiment]:
        """Run a batch and return it in the same order, each with its outcome; reusable results (`load`) are not
        run again. On KeyboardInterrupt the running ones are killed and recorded as interrupted, and it is re-raised.

        Raises:
            ConfigError: a name's directory is not a direct child of ``exps_dir``, or an experiment can never fit
                the pool; before any of the batch launches.
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
                self.cached.add(done.name)
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
                exp.error += _timeout_locks(extensions_dir(self.exps_dir), started)
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


def _timeout_locks(ext_dir: Path, started: float) -> str:
    """What the torch extension locks in ``ext_dir`` say of a run started at ``started`` that timed out, or '': one
    older than the run was left by a killed process; one taken since is an op build the stop killed."""

    old = stale_locks(ext_dir, older_than=started)
    new = [lock for lock in stale_locks(ext_dir) if lock not in old]
    said = ""
    if old:
        said += (f"; {', '.join(map(str, old))} was there before it started: a torch extension lock left by a killed "
                 f"process, which DeepSpeed's op loader waits on (removed before the next experiment when none runs)")
    if new:
        said += (f"; it was stopped while the JIT op {', '.join(lock.parent.name for lock in new)} was being built "
                 f"({', '.join(map(str, new))} taken during the run): the build died with it, and the next run "
                 f"builds the op again; a --timeout above the build's time (about a minute per op on 2 cores), or "
                 f"the ops built once before tuning (make setup), avoids it")
    return said
