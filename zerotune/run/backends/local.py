"""The local backend: the real ``deepspeed`` launcher as a subprocess, one process group per run.

Rules: the backend only starts, supervises and stops processes: the experiment directory is `zerotune.run.expdir`'s,
the command `zerotune.deepspeed.launcher`'s, starting and stopping ranks its starter's (`zerotune.run.backends.direct`).
Each run is one process group in its own session, killed whole on timeout, hang, Ctrl-C or when its stop rule ends
it (`zerotune.core.stopping`), stragglers by its token (`zerotune.run.processes`). Every run has a timeout
(`zerotune.run.backends.timeout`); ``--hang-timeout`` kills a run without progress. On this machine alone, with
``LaunchSpec.warm``, ranks are forked from a warm rank server (`zerotune.run.warm`).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil

from zerotune.core.experiment import LAUNCH_COLD, LAUNCH_WARM, Experiment, ExperimentKind, Status
from zerotune.core.launch import LaunchSpec, Reservation, RunLaunch
from zerotune.core.measure import load_quantiles
from zerotune.core.stopping import EndReason
from zerotune.deepspeed.launcher import free_port, paste_command, release_port
from zerotune.probe import clean_exits, read_streams, run_phases
from zerotune.run import expdir
from zerotune.run.backends.base import Backend, limit_data
from zerotune.run.backends.direct import DirectStarter, RankStarter, popen_cold, warm_note, warm_server_env
from zerotune.run.backends.timeout import Timeout, experiment_timeout
from zerotune.run.backends.watch import RunProgress, StreamWatch
from zerotune.run.processes import (
    RUN_TOKEN_ENV,
    RUNNING_DIR,
    adopt_orphans,
    data_bytes,
    new_run_token,
    reap_orphans,
    remove_shm_buffers,
    runs_script,
    write_running_record,
)
from zerotune.run.store import open_log
from zerotune.run.warm.client import WarmRun, WarmServer, WarmUnavailable

__all__ = ["LocalBackend"]

RESCAN_S = 1.0
"""How often a running run's process tree is walked again, s (the walk reads every process's ``stat``: about 1 ms a
poll on a quiet machine); its known ranks' memory is sampled at every poll."""


class LocalBackend(Backend):
    """Runs and supervises each experiment; ``starter`` starts and stops its ranks (default:
    `zerotune.run.backends.direct.DirectStarter`, from this machine).

    The warm server starts at the first run and stops at `close`; ``cmd.txt`` always shows the cold line. A run the
    server could not launch goes cold and says why in ``launch_note``; one whose server went away, or whose ranks
    failed before the script started, is run again cold."""

    poll_s = 0.2

    def __init__(self, spec: LaunchSpec, starter: RankStarter | None = None):
        self.spec = spec
        self.starter: RankStarter = starter if starter is not None else DirectStarter(spec)
        self._running: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._warm: WarmServer | None = None

    def use_spec(self, spec: LaunchSpec) -> None:
        """Launch the runs that follow as ``spec`` says, the starter's included; call only between runs."""
        self.spec = self.starter.spec = spec

    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        warm = self._warm_server(reservation, Path(exp_dir).parent / RUNNING_DIR)
        exp = self._run(exp, reservation, exp_dir, warm)
        if exp.launch == LAUNCH_WARM and exp.launch_note and not self._cancelled.is_set():
            note = exp.launch_note  # not the script's failure: the warm start's; the run counts cold
            exp = self._run(exp, reservation, exp_dir, None)
            exp.launch_note = f"re-run cold: {note}"
        return exp

    def _run(self, exp: Experiment, reservation: Reservation, exp_dir: Path, warm: WarmServer | None) -> Experiment:
        """Run ``exp`` once: forked from ``warm`` where it can launch it, else through DeepSpeed's launcher."""
        spec = self.spec
        exp_dir = Path(exp_dir)
        running_dir = exp_dir.parent / RUNNING_DIR
        reap_orphans(running_dir)  # first: an orphan of a killed tuner could still write into exp_dir
        watch = StreamWatch(exp_dir, spec.stop_rule, exp, spec.end_profile_step)
        if exp.kind is not ExperimentKind.PROFILE:
            load_quantiles()  # before the launch: its import would take CPU from the steps measured
        config_path = expdir.prepare(exp, exp_dir, spec.objective, spec.start_profile_step, watch.end_step)

        run = RunLaunch(exp.name, reservation, exp_dir, str(config_path), free_port(), new_run_token())
        starter, port, token = self.starter, run.port, run.token
        env, cmd = starter.command(run)
        (exp_dir / expdir.CMD_FILE).write_text(paste_command(env, cmd) + "\n")

        record = write_running_record(running_dir, exp.name, token, port, stop=starter.stop_handle(token))
        seen = _Supervised(timeout=experiment_timeout(spec.timeout_s, exp, exp_dir.parent))
        exp.launch, exp.launch_note = LAUNCH_COLD, _cold_note(spec)
        if warm is not None:  # its preload is the tuning's, not this run's: the run's clock starts after it
            try:
                warm.ready(self._cancelled)
            except WarmUnavailable as e:
                warm, exp.launch_note = None, f"launched cold: {e}"
        start, since = time.monotonic(), time.time()
        with open_log(exp_dir / expdir.STDOUT_LOG, append=False) as out, \
                open_log(exp_dir / expdir.STDERR_LOG, append=False) as err:
            try:
                proc = None
                if warm is not None:
                    try:
                        proc = starter.warm_launch(warm, run, {**os.environ, **env, RUN_TOKEN_ENV: token}, cmd,
                                                   (out, err))
                        exp.launch = LAUNCH_WARM
                    except WarmUnavailable as e:
                        exp.launch_note = f"launched cold: {e}"
                if proc is None:
                    proc = popen_cold(cmd, {**os.environ, **env, RUN_TOKEN_ENV: token}, (out, err),
                                      _child_setup(starter.data_limit()))
            except BaseException:
                record.unlink(missing_ok=True)
                release_port(port)
                raise
            with self._lock:
                self._running[proc.pid] = proc
            known: dict[int, psutil.Process] = {}
            try:
                write_running_record(running_dir, exp.name, token, port, leader=proc.pid, since=since,
                                     stop=starter.stop_handle(token))
                self._supervise(proc, exp, run, watch, start, known, seen)
            finally:
                starter.stop(proc, known, token, since)
                remove_shm_buffers(port)
                record.unlink(missing_ok=True)
                with self._lock:
                    self._running.pop(proc.pid, None)
                release_port(port)
        exp = self._finish(exp, exp_dir, proc.returncode, start, seen)
        if exp.launch == LAUNCH_WARM:
            exp.launch_note = starter.warm_failure(proc, exp_dir)
        return exp

    def _warm_server(self, reservation: Reservation, running_dir: Path) -> WarmServer | None:
        """The warm rank server for runs on ``reservation``, started on first use (None: this run goes cold)."""
        if not self.starter.warm_eligible(reservation):
            return None
        with self._lock:
            if self._warm is None:
                self._warm = self.starter.new_warm_server(warm_server_env(self.spec, reservation, running_dir),
                                                          reservation, running_dir)
                self._warm.start()
                weakref.finalize(self, self._warm.stop)  # a backend dropped without close() (the API, tests)
            return self._warm

    def close(self) -> None:
        """Stop the warm rank server, if one was started (every run it launched ends with it)."""
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None:
            warm.stop()

    def _supervise(self, proc: subprocess.Popen, exp: Experiment, run: RunLaunch, watch: StreamWatch, start: float,
                   known: dict[int, psutil.Process], seen: _Supervised) -> None:
        """Watch the launched run until it exits, times out, hangs, is cancelled or its stop rule ends it, noting
        what it saw in ``seen`` and every process of its tree in ``known`` (for the kill). Progress, for
        ``--hang-timeout``: a new step in the probe's streams, or, before the first step, output."""
        spec = self.spec
        script_name = Path(spec.script).name
        progress = RunProgress(run.exp_dir, start)
        watch.launched_at = start
        ranks: list[psutil.Process] = []
        scanned = float("-inf")
        while proc.poll() is None:
            now = time.monotonic()
            if now - scanned >= RESCAN_S:
                scanned, tree = now, self.starter.ranks(proc, run.token)
                for child in tree:
                    known.setdefault(child.pid, child)
                ranks = [c for c in tree if _is_rank(proc, c, script_name)]  # not the launcher, nor a JIT compiler
            for child in ranks:
                seen.peak = max(seen.peak, data_bytes(child.pid))
            idle_s = progress.idle_s(now)
            if now - start > seen.timeout.seconds:
                seen.timed_out = True
            elif spec.hang_timeout_s is not None and idle_s > spec.hang_timeout_s:
                seen.timed_out, seen.hung, seen.stepped = True, True, progress.stepped
            if seen.timed_out or self._cancelled.is_set():
                break
            seen.ended = watch.check()
            if seen.ended is not None:  # enough measured: the same clean stop as a timeout
                break
            try:  # returns as soon as the launcher exits (a plain sleep adds poll_s / 2 on average)
                proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
        if seen.ended is None and watch.reached_cap() and (
                proc.returncode == 0 or clean_exits(run.exp_dir, exp.num_nodes * exp.num_slots)):
            # it exited past end_profile_step while the stop rule was still buying steps: at the engine's extended
            # exit (the cap), or at the script's own end before it (a non-zero exit after every rank's clean exit
            # record is a crash in the interpreter's teardown: measured all the same)
            seen.ended = EndReason.SCRIPT_END if watch.script_ended() else EndReason.STEP_CAP
            seen.teardown_crash = proc.returncode != 0

    def _finish(self, exp: Experiment, exp_dir: Path, exit_code: int | None, start: float,
                seen: _Supervised) -> Experiment:
        """Record the run's outcome in ``exp`` (`expdir.finish`), with the backend's reasons for a teardown crash, a
        timeout and a hang."""
        spec = self.spec
        exp.wall_s = round(time.monotonic() - start, 3)
        # the ranks' sampled VmData is what the CPU budget limits; on CUDA it is host memory, not the device's: the
        # device's peak comes from the probe's streams (expdir.finish), and a run without them (an OOM) has none
        exp.peak_memory_bytes = (seen.peak or None) if spec.cpu else None
        expdir.finish(exp, exp_dir, spec.objective, exit_code, seen.timed_out, interrupted=self._cancelled.is_set(),
                      ended=seen.ended)
        exp.startup_s, exp.measure_s = (None if v is None else round(v, 3)
                                        for v in run_phases(read_streams(exp_dir), start))
        if seen.teardown_crash and exp.status is Status.OK:
            exp.error = (f"exit code {exit_code} after every rank's script ended cleanly (a crash in the "
                         f"interpreter's teardown): the steps measured count")
        if exp.status is Status.TIMEOUT and seen.hung:
            exp.error = (f"no new step for {spec.hang_timeout_s:g} s: killed as hung" if seen.stepped
                         else f"no output for {spec.hang_timeout_s:g} s: killed as hung")
        elif exp.status is Status.TIMEOUT:
            exp.error = seen.timeout.reason()
        return self.starter.finish(exp)

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]] | None:
        """The starter's (`zerotune.run.backends.direct.RankStarter.training_launch`)."""
        return self.starter.training_launch(spec, reservation, config_path, master_port, ds_config)

    def cancel_all(self) -> None:
        """Stop every running experiment within ``poll_s``; runs without a result end INTERRUPTED."""
        self._cancelled.set()


@dataclass
class _Supervised:
    """What `LocalBackend._supervise` saw of a run."""

    timeout: Timeout = Timeout(float("inf"))  # the run's wall-clock bound
    timed_out: bool = False  # killed for its timeout or a hang
    hung: bool = False  # no progress for hang_timeout_s
    stepped: bool = False  # with hung: steps were recorded (no new step for hang_timeout_s)
    ended: EndReason | None = None  # the stop rule's answer, or SCRIPT_END when the script ended past the cap
    teardown_crash: bool = False  # a non-zero exit after every rank's clean exit record
    peak: int = 0  # the ranks' largest sampled VmData, bytes (0: none seen)


def _cold_note(spec: LaunchSpec) -> str:
    """Why a warm-enabled run of ``spec`` starts cold because its launcher's ranks cannot be forked, or ''."""
    why = warm_note(spec) if spec.warm else ""
    return f"launched cold: {why}" if why else ""


def _is_rank(proc: subprocess.Popen | WarmRun, child: psutil.Process, script_name: str) -> bool:
    """Whether ``child`` of run ``proc`` is a rank: a cold rank runs the script; a warm rank (the server's command
    line) is a child of the run's launcher."""
    if not isinstance(proc, WarmRun):
        return runs_script(child, script_name)
    try:
        return child.ppid() == proc.pid
    except psutil.Error:
        return False


def _child_setup(limit: int | None):
    """The launcher's pre-exec hook: ``RLIMIT_DATA`` at ``limit`` bytes (None: none), inherited by its ranks, and
    `zerotune.run.processes.adopt_orphans`."""

    def setup():  # runs in the child before exec
        limit_data(limit)
        adopt_orphans()
    return setup
