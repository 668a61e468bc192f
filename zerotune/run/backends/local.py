"""The local backend: the real ``deepspeed`` launcher as a subprocess, one process group per run.

The backend only starts, supervises and stops processes: the experiment directory (the config it
ran, the result files, the outcome) is :mod:`zerotune.run.expdir`'s, the launcher command
:mod:`zerotune.deepspeed.launcher`'s. It writes ``cmd.txt`` (a command a person can paste) and
redirects the launcher's output into ``stdout.log`` and ``stderr.log``. The launcher is started in
a new session so the whole tree (launcher and ranks) is killed as one process group on timeout,
hang or Ctrl-C, and any straggler, found by the run's token, is killed after it exits
(:mod:`zerotune.run.processes`). Multi-node reservations go through the launcher's own hostfile
mechanism (``--hostfile``, ``--force_multi``), never a blanket pkill.

While a run goes, the backend reads its step probe's streams as they grow and, when the launch
spec has a stop rule, ends the run as soon as the rule says its metric is known or cannot beat the
incumbent (adaptive experiments, :mod:`zerotune.core.stopping`), with the same process-group stop.
"""
from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from pathlib import Path

import psutil

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.stopping import EndReason, StopRule, extended_end_step
from zerotune.deepspeed.launcher import free_port, launch_command, launch_env, paste_command, release_port
from zerotune.probe import StepRecord, clean_exits, read_streams, stream_files
from zerotune.run import expdir
from zerotune.run.backends.base import Backend, LaunchSpec
from zerotune.run.processes import (RUN_TOKEN_ENV, RUNNING_DIR, data_bytes, descendants, kill_tree, new_run_token,
                                    reap_orphans, remove_shm_buffers, runs_script, write_running_record)
from zerotune.run.slots import Reservation

__all__ = ["LocalBackend"]


class LocalBackend(Backend):
    """Runs each experiment through the ``deepspeed`` launcher as a subprocess of this machine."""

    poll_s = 0.2

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._running: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        spec = self.spec
        exp_dir = Path(exp_dir)
        running_dir = exp_dir.parent / RUNNING_DIR
        reap_orphans(running_dir)  # first: an orphan of a killed tuner could still write into exp_dir
        watch = _StreamWatch(exp_dir, spec.stop_rule, exp, spec.end_profile_step)
        end_step = extended_end_step(spec.end_profile_step) if watch.rule is not None else spec.end_profile_step
        config_path = expdir.prepare(exp, exp_dir, spec.objective, spec.start_profile_step, end_step)

        port = free_port()
        env = launch_env(spec, reservation, probe_dir=exp_dir)
        cmd = launch_command(spec, reservation, str(config_path), port, direct=True)
        (exp_dir / expdir.CMD_FILE).write_text(paste_command(env, cmd) + "\n")

        limit = spec.device_memory_bytes if spec.cpu else None

        def limit_memory():  # runs in the child before exec; inherited by the launcher's ranks
            if limit:
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        script_name = Path(spec.script).name
        token = new_run_token()
        record = write_running_record(running_dir, exp.name, token, port)
        start = time.monotonic()
        timed_out = hung = teardown_crash = False
        ended: EndReason | None = None
        peak = 0
        with open(exp_dir / expdir.STDOUT_LOG, "wb") as out, open(exp_dir / expdir.STDERR_LOG, "wb") as err:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **env, RUN_TOKEN_ENV: token}, start_new_session=True,
                                        preexec_fn=limit_memory)
            except BaseException:
                record.unlink(missing_ok=True)
                release_port(port)
                raise
            with self._lock:
                self._running[proc.pid] = proc
            known: dict[int, psutil.Process] = {}
            last_size, last_change = -1, start
            watch.launched_at = start
            try:
                while proc.poll() is None:
                    now = time.monotonic()
                    for child in descendants(proc.pid):
                        known.setdefault(child.pid, child)
                        if runs_script(child, script_name):  # not the launcher, nor a JIT compiler
                            peak = max(peak, data_bytes(child.pid))
                    size = expdir.output_bytes(exp_dir)
                    if size != last_size:
                        last_size, last_change = size, now
                    if spec.timeout_s is not None and now - start > spec.timeout_s:
                        timed_out = True
                    elif spec.hang_timeout_s is not None and now - last_change > spec.hang_timeout_s:
                        timed_out = hung = True
                    if timed_out or self._cancelled.is_set():
                        break
                    if (ended := watch.check()) is not None:  # enough measured: the same clean stop as a timeout
                        break
                    try:  # returns as soon as the launcher exits (a plain sleep adds poll_s / 2 on average)
                        proc.wait(timeout=self.poll_s)
                    except subprocess.TimeoutExpired:
                        pass
                if ended is None and watch.reached_cap() and (
                        proc.returncode == 0 or clean_exits(exp_dir, exp.num_nodes * exp.num_slots)):
                    # the script ended past end_profile_step, before the extended exit (a non-zero exit after
                    # every rank's clean exit record is a crash in the interpreter's teardown: measured all the same)
                    ended = EndReason.STEP_CAP
                    teardown_crash = proc.returncode != 0
            finally:
                kill_tree(proc, known, token)
                remove_shm_buffers(port)
                record.unlink(missing_ok=True)
                with self._lock:
                    self._running.pop(proc.pid, None)
                release_port(port)
        exp.wall_s = round(time.monotonic() - start, 3)
        # the ranks' sampled VmData is what the CPU budget limits; on CUDA it is host memory, not the device's: the
        # device's peak comes from the probe's streams (expdir.finish), and a run without them (an OOM) has none
        exp.peak_memory_bytes = (peak or None) if spec.cpu else None
        expdir.finish(exp, exp_dir, spec.objective, proc.returncode, timed_out, interrupted=self._cancelled.is_set(),
                      ended=ended)
        if teardown_crash and exp.status is Status.OK:
            exp.error = (f"exit code {proc.returncode} after every rank's script ended cleanly (a crash in the "
                         f"interpreter's teardown): the steps measured count")
        if exp.status is Status.TIMEOUT:
            exp.error = (f"no output for {spec.hang_timeout_s:g} s: killed as hung" if hung
                         else f"killed after the {spec.timeout_s:g} s timeout")
        return exp

    def cancel_all(self) -> None:
        """Stop every running experiment: each run's supervising loop sees it within ``poll_s`` and
        kills its process tree; runs without a result are recorded as INTERRUPTED."""
        self._cancelled.set()


class _StreamWatch:
    """Reads an experiment's probe streams while it runs and asks the stop rule whether it can end
    (:mod:`zerotune.core.stopping`). The streams are re-read only when a file grew, so a poll costs a
    few ``stat`` calls; the profile run (which exits in its first forward) is never watched.

    The run was launched with an extended engine exit (:func:`~zerotune.core.stopping.extended_end_step`):
    the rule ends it at ``end_profile_step`` unless more steps pay, within its start-up time, from the
    launch (``launched_at``, ``time.monotonic()``) to its first step's start (the probe's ``t`` is the
    same system-wide monotonic clock: the ranks run on this machine)."""

    def __init__(self, exp_dir: Path, rule: StopRule | None, exp: Experiment, end_profile_step: int):
        self.exp_dir, self.exp = exp_dir, exp
        self.rule = None if exp.kind is ExperimentKind.PROFILE else rule
        self.cap_step = end_profile_step + 1  # DeepSpeed's exiting step is recorded too
        self.launched_at: float | None = None
        self._sizes: dict[int, int] = {}
        self._streams: dict[int, list[StepRecord]] = {}

    def check(self) -> EndReason | None:
        if self.rule is None:
            return None
        sizes = {rank: expdir.file_size(path) for rank, path in stream_files(self.exp_dir).items()}
        if sizes == self._sizes:
            return None
        self._sizes = sizes
        self._streams = read_streams(self.exp_dir)
        return self.rule.check(self._streams, self.exp.must_beat, self.cap_step, self.startup_s())

    def startup_s(self) -> float | None:
        """Seconds from the launch to the start of the first step (None: not known yet)."""
        firsts = [records[0] for records in self._streams.values() if records]
        starts = [r.t - r.step_s for r in firsts if r.t is not None and r.step_s is not None]
        if self.launched_at is None or not starts:
            return None
        return max(0.0, min(starts) - self.launched_at)

    def reached_cap(self) -> bool:
        """Whether every rank recorded ``end_profile_step``'s exiting step (read afresh)."""
        if self.rule is None:
            return False
        streams = read_streams(self.exp_dir)
        return bool(streams) and all(any(r.step is not None and r.step >= self.cap_step for r in records)
                                     for records in streams.values())
