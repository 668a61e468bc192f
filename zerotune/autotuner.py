"""The ``Autotuner``: the Python API, shaped like DeepSpeed's own so a DeepSpeed user recognises it.

Build it from the launcher's arguments and resources, then ``tune()``, ``print_tuning_results()``,
``write_optimal_config()`` and ``run_after_tuning()``; ``plan()`` is the dry run. It only wires the parts together:
the `zerotune.inputs.job.Job` (inputs), the `zerotune.strategy.tuning.Strategy` (what to run), the scheduler and a
backend (running it) and `zerotune.report` (the answer); a run's lifetime on its directories (signals, locks,
reaping, the extension cache) is `zerotune.run._lifetime`'s.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console

from zerotune.core.errors import ConfigError, TuningFailed
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.launch import Node, Reservation
from zerotune.deepspeed.args import step_flag
from zerotune.deepspeed.auto import auto_paths
from zerotune.deepspeed.launcher import (
    DEFAULT_MASTER_PORT,
    free_port,
    launch_command,
    launch_env,
    multi_node,
    paste_command,
    script_arguments,
)
from zerotune.deepspeed.rank_env import RUNNER_ENV_FILE, runner_env_file, user_env_texts
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job, TuneOptions
from zerotune.launchers.base import Launcher
from zerotune.report import notes, results
from zerotune.report.data import ReportData, TrainingPlan
from zerotune.report.log import to_console
from zerotune.report.plan import Plan
from zerotune.report.progress import Progress
from zerotune.report.publish import Refresher
from zerotune.run._lifetime import (
    Interrupted,
    build_note,
    publish_extensions,
    run_training,
    signals_deferred,
    tuning_lifetime,
)
from zerotune.run.backends import make_backend
from zerotune.run.backends.base import Backend
from zerotune.run.resources import SlotPool
from zerotune.run.resume import resume_context
from zerotune.run.scheduler import Scheduler
from zerotune.strategy.oracle import PROFILE_ON_DISK, MemoryOracle
from zerotune.strategy.result import StrategyResult
from zerotune.strategy.tuning import Strategy

__all__ = ["Autotuner", "Interrupted", "TuneOptions"]

logger = logging.getLogger(__name__)

def _check_stage_configs(job: Job) -> None:
    """Build and validate the user's config at every ZeRO stage to explore, at the smallest mbs, so a bad setting
    (``reduce_bucket_size: 0``) is exit 2 before the first launch. A config with ``"auto"`` values (a Hugging Face
    Trainer's) is built only after the profile run resolves them.

    Raises:
        ConfigError: naming the config file and the key.
    """
    if auto_paths(job.user_config):  # "auto" settings the profile run resolves: built after it
        return
    builder = ConfigBuilder(job)
    for stage in job.stages:
        try:
            builder.config(stage, job.min_mbs)
        except ConfigError as e:
            raise ConfigError(str(e) if job.config_path in str(e) else f"{job.config_path}: {e}") from None


class Autotuner:
    """Find the fastest DeepSpeed config for a training script on the given resources.

    Args:
        script_args: the script's arguments, carrying ``--deepspeed_config PATH`` (or ``--deepspeed PATH``).
        nodes: the device slots to use (``resources.select_resources``).
        backend: runs the experiments (default: the local ``deepspeed`` launcher; Ray with ``options.backend ==
            "ray"``, Slurm job steps with ``"slurm"``); any `Backend`, e.g. a simulated cluster.
        launcher: the user's launcher (`zerotune.launchers.command.read_command`); None: the ``deepspeed``
            launcher, with the config in ``script_args``.

    Raises:
        ConfigError: any bad input (`Job.build`); without ``backend``, a training script that is not a file.
    """

    def __init__(self, script: str, script_args: Sequence[str], nodes: Sequence[Node],
                 options: TuneOptions | None = None, console: Console | None = None, backend: Backend | None = None,
                 launcher: Launcher | None = None):
        self.job = job = Job.build(script, script_args, nodes, options, launcher)
        if backend is None and not Path(job.script).is_file():  # a simulated backend runs no script
            raise ConfigError(f"training script {job.script!r} does not exist (or is not a file)")
        _check_stage_configs(job)
        if job.backend != "slurm" and any(n.host != "localhost" for n in job.nodes):  # DeepSpeed's runner may start
            user_env_texts()  # ranks there and read its env files at each launch: one it cannot read is exit 2 now
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.backend = backend or make_backend(job.backend, job.launch_spec(), job.ray_address)
        self.pool = SlotPool(list(job.nodes))
        self.progress = Progress(self.console, job.objective)
        self.scheduler = Scheduler(self.backend, self.pool, job.exps_dir, on_update=self._on_update,
                                   context=resume_context(job))
        options = options or TuneOptions()
        self.training_plan = TrainingPlan(options.train_samples, options.train_steps, options.cost_per_device_hour,
                                          options.peak_tflops)
        self.answer_port = options.master_port or DEFAULT_MASTER_PORT
        self.report = Refresher(job.results_dir, self.report_data)
        self.result = StrategyResult()
        self.best: Experiment | None = None
        self.elapsed_s = 0.0
        self.started_at: float | None = None  # when tune() began, seconds since the epoch (the summary's launches)
        self._started: float | None = None  # the same, time.monotonic()
        self.cost_plan: tuple[int, float, frozenset[str]] | None = None  # launches, device-s, names: once profiled

    @property
    def _notes(self) -> list[str]:
        built = build_note(self.job.exps_dir, self.started_at)
        planned = [] if self.cost_plan is None else [
            results.plan_line(*self.cost_plan[:2], self.scheduler.history),
            *results.unplanned_lines(self.cost_plan[2], self.scheduler.history)]
        steps_arg = self.job.autotuning.max_steps_arg
        length = notes.run_length_note(self.result.experiments, self.result.ledger.answer, self.result.ledger.precision,
                                         step_flag(self.job.script_args, steps_arg), bool(steps_arg))
        return [*notes.strategy_notes(self.result, self.job.device_memory_bytes, self.job.dp_world_size),
                *([length] if length else []), *planned, self.job.batch.describe(), self._launcher_line(),
                *([built] if built else [])]

    def _launcher_line(self) -> str:
        return f"launcher: {self.job.launcher.describe(self.job.script)}; ds_config from {self.job.config_source}"

    def _on_update(self, exp: Experiment, event: str) -> None:
        self.progress.update(exp, event)
        if event in ("end", "cached"):
            self.report.refresh()

    def report_data(self, state: str = "running") -> ReportData:
        """What ``report.html``, ``results.csv`` and ``results.json`` show now; ``state``: one of
        `zerotune.report.data.STATES`."""
        job = self.job
        return ReportData.from_tuning(list(self.scheduler.history), self.result, objective=job.objective,
                                      budget_bytes=job.device_memory_bytes, capacity_bytes=job.capacity_bytes,
                                      exps_dir=job.exps_dir, context=self.scheduler.context, notes=self._notes,
                                      state=state, plan=self.training_plan, cached=frozenset(self.scheduler.cached),
                                      since=self.started_at, elapsed_s=self._elapsed())

    def _elapsed(self) -> float:
        """The tuning time, s: so far while it runs, its whole once it ended."""
        if self._started is not None and not self.elapsed_s:
            return time.monotonic() - self._started
        return self.elapsed_s

    @property
    def stage_results(self):
        """How each ZeRO stage was handled (`zerotune.strategy.stages.StageResult`)."""
        return self.result.stages

    def _strategy(self, evaluate) -> Strategy:
        return Strategy(self.job, evaluate, parallel=self.pool.capacity(self.job.num_nodes, self.job.slots_per_node))

    def tune(self) -> Experiment:
        """Profile, search and write the results; return the best experiment.

        SIGINT, SIGTERM and SIGHUP stop it as Ctrl-C does (from the main thread): the running experiments are killed
        with all their processes and recorded as interrupted, the finished results and the summary are written, and
        `Interrupted` is raised; a rerun resumes. A signal while the results are written waits until they are whole.
        It holds the results and exps dirs' locks throughout (`zerotune.run.store.tuning_locks`): one tuner per dir.

        Raises:
            TuningFailed: the profile run or every experiment failed (the summary says so), or the results cannot be
                written (a full disk).
            ConfigError: the results or exps dir cannot be created, or is in use by another tuner; an
                experiment's directory is a symlink.
            Interrupted: a stop signal arrived (a KeyboardInterrupt naming the signal).
        """
        started, job = time.monotonic(), self.job
        self.started_at, self._started = time.time(), started
        with to_console(self.console), tuning_lifetime(job.results_dir, job.exps_dir, job.overwrite):
            for note in (job.describe(), self._launcher_line(), *job.notes):
                self.console.print(note, markup=False, highlight=False)
            strategy = self._strategy(self.scheduler.run)
            self.result = strategy.result  # filled in as it runs: a failure still reports what was learnt
            interrupted = False
            try:
                self.progress.start(started)
                strategy.run()
                publish_extensions(job.exps_dir)
            except KeyboardInterrupt:
                interrupted = True
                raise
            finally:
                self.backend.close()  # the warm rank server ends with the tuning, however it ends
                with signals_deferred():  # the old answer or the new one, whole
                    self.progress.stop()
                    self.elapsed_s = time.monotonic() - started
                    self.cost_plan = None if interrupted else self._cost_plan()
                    unwritten = self._write_results()  # never masks the exception in flight (an interrupt)
                    state = "interrupted" if interrupted else "finished" if self.best is not None else "failed"
                    self.report.refresh(state, force=True)  # logs a failure, never raises
        if unwritten is not None:
            raise TuningFailed(f"cannot write the results: {unwritten}; the experiments' records under "
                               f"{job.exps_dir} are kept: free some space and rerun to resume")
        if self.best is None:
            raise TuningFailed(f"no experiment succeeded; see {job.results_dir / 'summary.txt'} and the logs "
                               f"under {job.exps_dir}")
        return self.best

    def _write_results(self) -> OSError | None:
        """`write_optimal_config`, or the OSError that stopped it (a full disk), said in the log."""
        try:
            self.best = self.write_optimal_config()
        except OSError as e:
            self.best = None
            logger.error(f"zerotune: cannot write the results: {e}")
            return e
        return None

    def plan(self) -> Plan:
        """The dry run: the experiments the strategy would try if the memory model were right
        (`zerotune.strategy.oracle`), with bytes per device and fits; nothing is launched or written."""
        oracle = MemoryOracle(self.job, self.scheduler.load)
        with to_console(self.console):
            result = self._strategy(oracle).run()
        return Plan.from_experiments(result.experiments, oracle.model_info_source, self.job.device_memory_bytes,
                                     self.job.dp_world_size, skip_profile=oracle.model_info_source == PROFILE_ON_DISK)

    def _cost_plan(self) -> tuple[int, float, frozenset[str]] | None:
        """(launches, device-seconds, their names) the tuning planned once profiled: `plan`'s experiments besides the
        profile, on the memory model calibrated by it, each priced at the profile run's device-seconds. None without
        an ok profile run, or where the plan cannot be made (said in the log)."""
        profile = next((e for e in self.scheduler.history
                        if e.kind is ExperimentKind.PROFILE and e.status is Status.OK), None)
        if profile is None:
            return None
        root = logging.getLogger("zerotune")
        level = root.level
        root.setLevel(logging.ERROR)  # the plan's strategy logs what the real one already said
        try:
            planned = self._strategy(MemoryOracle(self.job, self.scheduler.load)).run().experiments
        except Exception as e:  # the plan is a note: it never fails a tuning
            logger.debug(f"no cost plan: {e}")
            return None
        finally:
            root.setLevel(level)
        names = frozenset(e.name for e in planned
                          if e.kind is not ExperimentKind.PROFILE and e.status in (Status.OK, Status.OOM))
        return len(names), len(names) * results.device_seconds(profile), names

    def write_optimal_config(self) -> Experiment | None:
        """Write ``summary.txt``, ``ds_config_optimal.json`` and ``cmd_optimal.txt``; return the best."""
        return results.write_results(self.job.results_dir, self.report_data("finished"), self.optimal_answer)

    def print_tuning_results(self) -> None:
        """Print the summary table (the same as ``summary.txt``)."""
        data = self.report_data("finished")
        results.print_wide(self.console, results.render_table(data))
        if data.answer is not None:
            self.console.print(results.answer_text(data).strip(), soft_wrap=True, markup=False)
            self.console.print(f"report:         {self.job.results_dir / 'report.html'}", soft_wrap=True,
                               markup=False, highlight=False)
            self.console.print(f"optimal config: {self.job.results_dir / 'ds_config_optimal.json'}\n"
                               f"command:        {(self.job.results_dir / 'cmd_optimal.txt').read_text().strip()}")

    def _training_launch(self, config_path: str, master_port: int,
                         ds_config: dict | None = None) -> tuple[dict[str, str], list[str], dict[str, str]]:
        """(environment additions, command, files beside the config: name -> text) that train on all selected slots
        with ``config_path`` (``ds_config``: its content where it is not written yet)."""
        every_slot = Reservation(tuple(Node(n.host, n.slots[:self.job.slots_per_node]) for n in self.job.nodes))
        # absolute paths: the command works from any directory
        spec = dataclasses.replace(self.job.launch_spec(), script=str(Path(self.job.script).absolute()))
        config_path = str(Path(config_path).absolute())
        own = self.backend.training_launch(spec, every_slot, config_path, master_port, ds_config=ds_config)
        if own is not None:
            return (*own, {})
        if spec.launcher is not None:  # the user's own command, with the config in place
            answer = self.job.launcher.answer(spec.script, script_arguments(spec, config_path, ds_config), config_path,
                                              self.job.results_dir, ds_config)
            return (launch_env(dataclasses.replace(spec, launcher=None), every_slot), list(answer.words),
                    dict(answer.files))
        env = launch_env(spec, every_slot)
        if multi_node(spec, every_slot):  # the other nodes' ranks get the launch's environment from this file
            env.update(runner_env_file(env, self.job.results_dir / RUNNER_ENV_FILE))
        return env, launch_command(spec, every_slot, config_path, master_port, ds_config=ds_config), {}

    def optimal_command(self, config_path: str, ds_config: dict | None = None) -> str:
        """The command that trains with ``config_path`` on all selected slots in the user's launcher (the script and
        the config by absolute path); ``ds_config``: that file's content where it is not written yet (the results are
        written after every text is made: `zerotune.report.results.write_results`)."""
        return self.optimal_answer(config_path, ds_config)[0]

    def optimal_answer(self, config_path: str, ds_config: dict | None = None) -> tuple[str, dict[str, str]]:
        """`optimal_command` and the files it needs beside the config (name -> text: for Accelerate,
        ``accelerate_config_optimal.yaml``, `zerotune.launchers.base.Launcher.answer`)."""
        env, words, files = self._training_launch(config_path, master_port=self.answer_port, ds_config=ds_config)
        return paste_command(env, words), files

    def run_after_tuning(self) -> int:
        """Launch the training with the optimal config (the ``cmd_optimal.txt`` command); return the launcher's exit
        status (negative: killed by that signal; `zerotune.cli.training_status` maps it). A stop signal is passed on
        to it and raises `Interrupted`; the training never outlives zerotune.

        Raises:
            TuningFailed: there is no optimal configuration.
        """
        if self.best is None:
            raise TuningFailed("no optimal configuration to run")
        config_path = str((self.job.results_dir / "ds_config_optimal.json").resolve())
        port = free_port()
        env, cmd, _ = self._training_launch(config_path, master_port=port)
        self.console.print(f"[bold]running[/]: {paste_command(env, cmd)}")
        return run_training(cmd, env, port)
