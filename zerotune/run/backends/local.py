"""The local backend: the real ``deepspeed`` launcher as a subprocess, one process group per run.

The backend only starts, supervises and stops processes: the experiment directory (the config it
ran, the result files, the outcome) is :mod:`zerotune.run.expdir`'s, the launcher command
:mod:`zerotune.deepspeed.launcher`'s. It writes ``cmd.txt`` (a command a person can paste) and
redirects the launcher's output into ``stdout.log`` and ``stderr.log``. The launcher is started in
a new session, as a child subreaper, so the whole tree (launcher and ranks, and any process they orphan) is
killed as one process group on timeout, hang or Ctrl-C, and any straggler, found by the run's session, group
or token, is killed after it exits (:mod:`zerotune.run.processes`).

Every run has a timeout, ``--timeout`` or a default derived from the profile run
(:mod:`zerotune.run.backends.timeout`). With ``--hang-timeout`` a run that makes no progress for that long is
killed as hung: progress is a step recorded in the probe's streams, and, before the first step (start-up, JIT
builds, the profile run), output; once a run has recorded a step, output alone (a heartbeat, a warning printed
in a loop) is no progress, and silence between steps is no hang. Multi-node reservations go through the launcher's own hostfile
mechanism (``--hostfile``, ``--force_multi``) and are stopped by their run's token on every node
(:func:`~zerotune.run.processes.kill_token_on`), never by the runner's own blanket pkill.

On this machine alone, with ``LaunchSpec.warm`` (the default), a run's ranks are forked instead from a warm rank
server the backend starts at its first run and stops at :meth:`LocalBackend.close` (:mod:`zerotune.run.warm`): the
run's launcher it forks leads a session of its own, so it is supervised and stopped as the launcher's process group
is, and ``cmd.txt`` still shows the launcher's line. A run the server could not launch goes cold and says why in
``launch_note``; one whose server went away, or whose ranks failed before the script started, is run again cold.

While a run goes, the backend reads its step probe's streams as they grow and, when the launch
spec has a stop rule, ends the run as soon as the rule says its metric is known or cannot beat the
incumbent (adaptive experiments, :mod:`zerotune.core.stopping`), with the same process-group stop.
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
from zerotune.core.launch import LaunchSpec, Reservation
from zerotune.core.measure import load_quantiles
from zerotune.core.stopping import EndReason, extended_end_step
from zerotune.deepspeed.launcher import (
    free_port,
    launch_command,
    launch_env,
    multi_node,
    paste_command,
    release_port,
    script_arguments,
)
from zerotune.deepspeed.rank_env import RUNNER_ENV_FILE, runner_env_file
from zerotune.launchers.contract import DEEPSPEED
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV, clean_exits, read_streams, run_phases
from zerotune.run import expdir
from zerotune.run.backends.base import Backend, limit_data
from zerotune.run.backends.timeout import Timeout, experiment_timeout
from zerotune.run.backends.watch import RunProgress, StreamWatch
from zerotune.run.processes import (
    RUN_TOKEN_ENV,
    RUNNING_DIR,
    adopt_orphans,
    data_bytes,
    descendants,
    kill_token_on,
    kill_tree,
    new_run_token,
    reap_orphans,
    remove_shm_buffers,
    runs_script,
    write_running_record,
)
from zerotune.run.warm.client import WarmRun, WarmServer, WarmUnavailable
from zerotune.run.warm.rank import SETUP_FAILED

__all__ = ["LocalBackend", "warm_server_env"]

RESCAN_S = 1.0
"""How often a running run's process tree is walked again, s (the walk reads every process's ``stat``: about 1 ms a
poll on a quiet machine); its known ranks' memory is sampled at every poll."""


class LocalBackend(Backend):
    """Runs each experiment through the ``deepspeed`` launcher as a subprocess of this machine."""

    poll_s = 0.2

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._running: dict[int, subprocess.Popen] = {}
        self._remote: dict[str, list[str]] = {}  # run token -> the hosts of a multi-node run
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._warm: WarmServer | None = None

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
        end_step = extended_end_step(spec.end_profile_step) if watch.rule is not None else spec.end_profile_step
        config_path = expdir.prepare(exp, exp_dir, spec.objective, spec.start_profile_step, end_step)

        port = free_port()
        token = new_run_token()
        env, cmd = self._launch(exp, reservation, exp_dir, str(config_path), port, token)
        (exp_dir / expdir.CMD_FILE).write_text(paste_command(env, cmd) + "\n")

        child_setup = _child_setup(self._data_limit())
        record = write_running_record(running_dir, exp.name, token, port, stop=self._stop_handle(token))
        seen = _Supervised(timeout=experiment_timeout(spec.timeout_s, exp, exp_dir.parent))
        exp.launch, exp.launch_note = LAUNCH_COLD, _cold_note(spec)
        if warm is not None:  # its preload is the tuning's, not this run's: the run's clock starts after it
            try:
                warm.ready(self._cancelled)
            except WarmUnavailable as e:
                warm, exp.launch_note = None, f"launched cold: {e}"
        start, since = time.monotonic(), time.time()
        with open(exp_dir / expdir.STDOUT_LOG, "wb") as out, open(exp_dir / expdir.STDERR_LOG, "wb") as err:
            try:
                proc = None
                if warm is not None:
                    try:
                        proc = self._warm_launch(warm, reservation, exp_dir, str(config_path), port, token,
                                                 {**os.environ, **env, RUN_TOKEN_ENV: token}, cmd, (out, err))
                        exp.launch = LAUNCH_WARM
                    except WarmUnavailable as e:
                        exp.launch_note = f"launched cold: {e}"
                if proc is None:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **env, RUN_TOKEN_ENV: token}, start_new_session=True,
                                            preexec_fn=child_setup)
            except BaseException:
                record.unlink(missing_ok=True)
                release_port(port)
                raise
            with self._lock:
                self._running[proc.pid] = proc
            known: dict[int, psutil.Process] = {}
            try:
                write_running_record(running_dir, exp.name, token, port, leader=proc.pid, since=since,
                                     stop=self._stop_handle(token))
                self._supervise(proc, exp, exp_dir, watch, start, known, seen, token)
            finally:
                self._stop(proc, known, token, since)
                remove_shm_buffers(port)
                record.unlink(missing_ok=True)
                with self._lock:
                    self._running.pop(proc.pid, None)
                release_port(port)
        exp = self._finish(exp, exp_dir, proc.returncode, start, seen)
        if exp.launch == LAUNCH_WARM:
            exp.launch_note = self._warm_failure(proc, exp_dir)
        return exp

    def _warm_launch(self, warm: WarmServer, reservation: Reservation, exp_dir: Path, config_path: str, port: int,
                     token: str, env: dict[str, str], cmd: list[str], logs: tuple) -> WarmRun:
        """Launch the run from ``warm``: its launch request (:func:`_warm_request`), from what the cold launch
        (``cmd``, ``env``: the whole environment) would run; ``logs``: the open ``stdout.log``, ``stderr.log``.

        Raises:
            WarmUnavailable: the server cannot launch it.
        """
        return warm.launch(_warm_request(self.spec, reservation, exp_dir, config_path, port, token, env,
                                         self._data_limit()))

    def _warm_failure(self, proc: WarmRun, exp_dir: Path) -> str:
        """Why the warm run ``proc`` failed for a reason of the warm start's, not the script's ('' when it did
        not): its server went away, or its ranks failed before the script started."""
        if proc.lost:
            return "its warm server went away during the run"
        if proc.returncode == SETUP_FAILED:
            return "its warm ranks failed before the script started (stderr.log says why)"
        return ""

    def _warm_server(self, reservation: Reservation, running_dir: Path) -> WarmServer | None:
        """The warm rank server for runs on ``reservation``, started on first use (None: this run goes cold,
        :meth:`_warm_eligible`). Its environment is the ranks' less the experiment's own probe variables."""
        if not self._warm_eligible(reservation):
            return None
        with self._lock:
            if self._warm is None:
                self._warm = self._new_warm_server(warm_server_env(self.spec, reservation, running_dir), reservation,
                                                   running_dir)
                self._warm.start()
                weakref.finalize(self, self._warm.stop)  # a backend dropped without close() (the API, tests)
            return self._warm

    def _warm_eligible(self, reservation: Reservation) -> bool:
        """Whether runs on ``reservation`` go warm: warm launches are on, the launcher's ranks can be forked
        (:func:`warm_note`), and it is this machine's alone."""
        return self.spec.warm and not warm_note(self.spec) and [n.host for n in reservation.nodes] == [
            "localhost"] and not multi_node(self.spec, reservation)

    def _new_warm_server(self, env: dict[str, str], reservation: Reservation, running_dir: Path) -> WarmServer:
        """A warm server (not started) whose ranks get ``env``: this machine's."""
        return WarmServer(self.spec.script, env, running_dir)

    def close(self) -> None:
        """Stop the warm rank server, if one was started (every run it launched ends with it)."""
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None:
            warm.stop()

    def _launch(self, exp: Experiment, reservation: Reservation, exp_dir: Path, config_path: str, port: int,
                token: str) -> tuple[dict[str, str], list[str]]:
        """The environment additions (shown in ``cmd.txt``) and the command that start ``exp``'s ranks (the run's
        ``token`` is added to the environment by the caller): here, DeepSpeed's launcher on ``reservation`` with
        master port ``port``, the probe writing into ``exp_dir``; on several nodes, the launch's environment
        written into the runner's env file ``exp_dir/deepspeed_env`` for the other nodes' ranks
        (:func:`~zerotune.deepspeed.rank_env.runner_env_file`)."""
        env = launch_env(self.spec, reservation, probe_dir=exp_dir, config_path=config_path)
        if multi_node(self.spec, reservation):  # the token too, so the other nodes' ranks are found by it
            env.update(runner_env_file({**env, RUN_TOKEN_ENV: token}, exp_dir / RUNNER_ENV_FILE))
            with self._lock:
                self._remote[token] = [n.host for n in reservation.nodes]
        return env, launch_command(self.spec, reservation, config_path, port, direct=True)

    def _data_limit(self) -> int | None:
        """The ``RLIMIT_DATA`` the launched command gets, bytes, inherited by its ranks (None: none)."""
        return self.spec.device_memory_bytes if self.spec.cpu else None

    def _stop_handle(self, token: str) -> dict[str, str] | None:
        """What a later tuner needs, besides the run's token and its launcher's session, to stop the run of
        ``token`` if this tuner dies: the running record's stop handle (:mod:`zerotune.run.backends.stop_handles`).
        None here: the token and the session find every process of a local run."""
        return None

    def _ranks(self, proc: subprocess.Popen, token: str) -> list[psutil.Process]:
        """The processes of the run to watch (sampled for peak memory, killed at the end): the launcher's tree."""
        return descendants(proc.pid)

    def _stop(self, proc: subprocess.Popen, known: dict[int, psutil.Process], token: str, since: float) -> None:
        """Stop the run and return once every process of it is gone (:func:`~zerotune.run.processes.kill_tree`).
        A multi-node run's runner is SIGKILLed first, alone (its own SIGTERM handler would pkill every DeepSpeed
        launcher on its hosts), then the run's processes on every node are killed by its token
        (:func:`~zerotune.run.processes.kill_token_on`)."""
        with self._lock:
            hosts = self._remote.pop(token, None)
        if hosts is not None:
            if proc.poll() is None:
                proc.kill()
            kill_token_on(hosts, token)
        kill_tree(proc, known, token, since)

    def _supervise(self, proc: subprocess.Popen, exp: Experiment, exp_dir: Path, watch: StreamWatch, start: float,
                   known: dict[int, psutil.Process], seen: _Supervised, token: str) -> None:
        """Watch the launched run until it exits, times out, hangs, is cancelled or its stop rule ends it,
        noting what it saw in ``seen``; every process of its tree seen is added to ``known`` (for the kill that
        follows)."""
        spec = self.spec
        script_name = Path(spec.script).name
        progress = RunProgress(exp_dir, start)
        watch.launched_at = start
        ranks: list[psutil.Process] = []
        scanned = float("-inf")
        while proc.poll() is None:
            now = time.monotonic()
            if now - scanned >= RESCAN_S:
                scanned, tree = now, self._ranks(proc, token)
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
                proc.returncode == 0 or clean_exits(exp_dir, exp.num_nodes * exp.num_slots)):
            # the script ended past end_profile_step, before the extended exit (a non-zero exit after
            # every rank's clean exit record is a crash in the interpreter's teardown: measured all the same)
            seen.ended = EndReason.STEP_CAP
            seen.teardown_crash = proc.returncode != 0

    def _finish(self, exp: Experiment, exp_dir: Path, exit_code: int | None, start: float,
                seen: _Supervised) -> Experiment:
        """Record the run's outcome in ``exp`` once its processes are gone (:func:`expdir.finish`), with the
        backend's more precise reasons for a teardown crash, a timeout and a hang."""
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
        return exp

    def cancel_all(self) -> None:
        """Stop every running experiment: each run's supervising loop sees it within ``poll_s`` and
        kills its process tree; runs without a result are recorded as INTERRUPTED."""
        self._cancelled.set()


@dataclass
class _Supervised:
    """What :meth:`LocalBackend._supervise` saw of a run."""

    timeout: Timeout = Timeout(float("inf"))  # the run's wall-clock bound
    timed_out: bool = False  # killed for its timeout or a hang
    hung: bool = False  # no progress for hang_timeout_s
    stepped: bool = False  # with hung: steps were recorded (no new step for hang_timeout_s)
    ended: EndReason | None = None  # the stop rule's answer, or STEP_CAP when the script ended past the cap
    teardown_crash: bool = False  # a non-zero exit after every rank's clean exit record
    peak: int = 0  # the ranks' largest sampled VmData, bytes (0: none seen)


def warm_server_env(spec: LaunchSpec, reservation: Reservation, running_dir: Path) -> dict[str, str]:
    """The environment of a warm server for ``spec``'s runs on ``reservation`` (its imports need the ranks'
    accelerator, ``PYTHONPATH`` and the exps dir's extension cache): this process's with the launch's
    (:func:`~zerotune.deepspeed.launcher.launch_env`), less an experiment's own probe variables (each run's request
    carries its own)."""
    env = {**os.environ, **launch_env(spec, reservation, probe_dir=running_dir.parent)}
    env.pop(PROBE_DIR_ENV, None)
    env.pop(BUDGET_ENV, None)
    return env


def warm_note(spec: LaunchSpec) -> str:
    """Why ``spec``'s ranks cannot be forked warm ('' when they can): its launcher's reason
    (:meth:`~zerotune.core.launch.UserLauncher.warm_note`)."""
    return spec.launcher.warm_note() if spec.launcher is not None else ""


def _cold_note(spec: LaunchSpec) -> str:
    """Why a run of ``spec`` starts cold when warm launches are on and its launcher's ranks cannot be forked ('':
    no such reason)."""
    why = warm_note(spec) if spec.warm else ""
    return f"launched cold: {why}" if why else ""


def _is_rank(proc: subprocess.Popen | WarmRun, child: psutil.Process, script_name: str) -> bool:
    """Whether ``child``, a process of the run ``proc``, is one of its ranks: a cold rank runs the script
    (:func:`~zerotune.run.processes.runs_script`); a warm rank, forked with the server's command line, is a child of
    the run's launcher."""
    if not isinstance(proc, WarmRun):
        return runs_script(child, script_name)
    try:
        return child.ppid() == proc.pid
    except psutil.Error:
        return False


def _warm_request(spec: LaunchSpec, reservation: Reservation, exp_dir: Path, config_path: str, port: int, token: str,
                  env: dict[str, str], data_limit: int | None) -> dict:
    """The warm server's launch request for a run on this machine alone (:mod:`zerotune.run.warm.server`): what the
    direct launch's command line says (:func:`~zerotune.deepspeed.launcher.launch_command`), as data."""
    contract = spec.launcher.contract if spec.launcher is not None else DEEPSPEED
    return {"script": spec.script, "args": script_arguments(spec, config_path), "env": env, "cwd": os.getcwd(),
            "contract": contract,
            "slots": list(reservation.nodes[0].slots), "master_addr": "127.0.0.1", "master_port": port,
            "stdout": str(exp_dir / expdir.STDOUT_LOG), "stderr": str(exp_dir / expdir.STDERR_LOG),
            "data_limit": data_limit, "probe_dir": str(exp_dir.resolve()), "token": token}


def _child_setup(limit: int | None):
    """The launcher's pre-exec hook: ``RLIMIT_DATA`` at ``limit`` bytes (None: no limit), inherited by the
    launcher's ranks, and the launcher made a child subreaper (:func:`~zerotune.run.processes.adopt_orphans`:
    what its ranks orphan stays in its tree)."""
    def setup():  # runs in the child before exec
        limit_data(limit)
        adopt_orphans()
    return setup
