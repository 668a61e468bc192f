"""The ``Autotuner``: ties config, resources, profile, memory model, search, scheduler and results.

Its shape mirrors DeepSpeed's own ``Autotuner`` so a DeepSpeed user recognises it: build it
from the launcher's arguments and resources, then ``tune()``, ``print_tuning_results()``,
``write_optimal_config()`` and ``run_after_tuning()``.
"""
from __future__ import annotations

import copy
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from zerotune.report import results as results_mod
from zerotune.run.backends.base import Backend, LaunchSpec
from zerotune.run.backends.local import (RUNNING_DIR, LocalBackend, free_port, launch_command, launch_env, paste_command,
                                     reap_orphans)
from zerotune.run.backends.ray import RayBackend
from zerotune.core.objective import Objective
from zerotune.core.units import format_bytes
from zerotune.deepspeed.config import (AutotuningConfig, find_config_arg, load_ds_config,
                             parse_autotuning, stage_candidates)
from zerotune.core.errors import ConfigError, TuningFailed
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.model.memory import MemoryModel
from zerotune.model.profile import ModelInfo, profile_config, read_model_info
from zerotune.report.plan import Plan, PlannedExperiment
from zerotune.report.progress import Progress
from zerotune.run.resources import Node, SlotPool
from zerotune.run.scheduler import ResultsLock, Scheduler
from zerotune.strategy.search import Point, StagePlan, StageResult, explore_stages, mbs_ladder
from zerotune.strategy.space import Candidate, config_hash, default_space, generate, is_list_valued, prune
from zerotune.strategy.tuners import make_tuner

PLATEAU_THRESHOLD = 0.01


@dataclass
class TuneOptions:
    """zerotune's own options (beyond the ds_config's ``autotuning`` section)."""

    device_memory_bytes: int | None = None
    results_dir: str | None = None
    timeout_s: float | None = None
    hang_timeout_s: float | None = None
    overwrite: bool | None = None
    hostfile: str | None = None
    cpu: bool | None = None  # None: CPU when CUDA is not available
    backend: str = "local"  # 'local' (deepspeed launcher subprocess) or 'ray' (a Ray cluster)
    ray_address: str | None = None  # backend 'ray': cluster address; None: $RAY_ADDRESS or a local instance


class Autotuner:
    """Find the fastest DeepSpeed config for a training script on the given resources.

    Args:
        script: the training script.
        script_args: its arguments, carrying ``--deepspeed_config PATH`` (or ``--deepspeed PATH``).
        nodes: the device slots to use (``resources.select_resources``).
        options: see :class:`TuneOptions`.
        backend: runs the experiments (default: :class:`LocalBackend` with this tuner's launch spec);
            any :class:`Backend`, e.g. Ray, or a simulated cluster in the benchmarks.

    Raises:
        ConfigError: bad config, bad ``autotuning`` section, no device memory budget on CPU.
    """

    def __init__(self, script: str, script_args: Sequence[str], nodes: Sequence[Node],
                 options: TuneOptions | None = None, console: Console | None = None,
                 backend: Backend | None = None):
        self.options = options or TuneOptions()
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.script = script
        self.script_args = list(script_args)
        _, self.config_path = find_config_arg(self.script_args)
        self.user_config = load_ds_config(self.config_path)
        self.at: AutotuningConfig = parse_autotuning(self.user_config.get("autotuning"), source=self.config_path)
        self.stages = stage_candidates(self.user_config, source=self.config_path)
        self.nodes = list(nodes)
        self.world_size = sum(len(n.slots) for n in self.nodes)
        # every experiment uses every selected node with the same slot count on each (the smallest)
        self.num_nodes, self.slots_per_node = len(self.nodes), min(len(n.slots) for n in self.nodes)
        if self.world_size % self.at.mp_size:
            raise ConfigError(f"{self.config_path}: 'autotuning.mp_size' = {self.at.mp_size} does not divide the "
                              f"{self.world_size} selected slots")
        self.dp_world_size = self.world_size // self.at.mp_size
        self.gas = _positive_int(self.user_config.get("gradient_accumulation_steps", 1),
                                 "gradient_accumulation_steps", self.config_path)
        self.cpu = self.options.cpu if self.options.cpu is not None else not _cuda_available()
        self.device_memory = self.options.device_memory_bytes or (None if self.cpu else _cuda_memory())
        if self.device_memory is None:
            raise ConfigError("--device-memory is required on a machine without CUDA (the per-rank budget, e.g. 3GiB)")
        self.objective = Objective.named(self.at.metric)
        self.results_dir = Path(self.options.results_dir or self.at.results_dir)
        self.exps_dir = self.results_dir / "exps" if self.options.results_dir else Path(self.at.exps_dir)
        self.overwrite = self.options.overwrite if self.options.overwrite is not None else self.at.overwrite
        self.spec = LaunchSpec(script=script, script_args=tuple(self.script_args), cpu=self.cpu,
                               device_memory_bytes=self.device_memory, timeout_s=self.options.timeout_s,
                               hang_timeout_s=self.options.hang_timeout_s, hostfile=self.options.hostfile,
                               start_profile_step=self.at.start_profile_step, end_profile_step=self.at.end_profile_step,
                               objective=self.objective)
        self.pool = SlotPool(self.nodes)
        if backend is None and self.options.backend not in ("local", "ray"):
            raise ConfigError(f"unknown backend {self.options.backend!r}: expected 'local' or 'ray'")
        self.backend = backend or (RayBackend(self.spec, self.options.ray_address) if self.options.backend == "ray"
                                   else LocalBackend(self.spec))
        self.progress = Progress(self.console, self.objective)
        self.scheduler = Scheduler(self.backend, self.pool, self.exps_dir, on_update=self.progress.update)
        self.model_info: ModelInfo | None = None
        self.memory: MemoryModel | None = None
        self.stage_results: list[StageResult] = []
        self.best: Experiment | None = None
        self.elapsed_s = 0.0
        self._started = 0.0

    # -- the tuning job ---------------------------------------------------------------------------
    def tune(self) -> Experiment:
        """Profile, search and write the results.

        Returns:
            The best experiment.

        Raises:
            TuningFailed: the profile run or every experiment failed (the summary says so).
        """
        self._started = time.monotonic()
        with ResultsLock(self.results_dir):
            # experiments a killed earlier tuner left running on this dir: stopped before anything
            # is deleted or cached results are trusted (a fully cached rerun launches nothing)
            reap_orphans(self.exps_dir / RUNNING_DIR)
            if self.overwrite:
                import shutil
                for path in (self.exps_dir, self.results_dir / "summary.txt"):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            try:
                self.progress.start(self._started)
                self._profile()
                self._explore()
                if not self.at.fast:
                    self._tune_knobs()
            finally:
                self.progress.stop()
                self.elapsed_s = time.monotonic() - self._started
                self.best = self.write_optimal_config()
        if self.best is None:
            raise TuningFailed(f"no experiment succeeded; see {self.results_dir / 'summary.txt'} and the logs "
                               f"under {self.exps_dir}")
        return self.best

    def _base_config(self, stage: int, mbs: int) -> dict[str, Any]:
        """The user's config at ``stage`` and ``mbs``; a key holding a list of candidates (a tuning
        space) takes its first candidate until the knob phase tunes it."""
        cfg = first_candidates(self.user_config)
        cfg.pop("autotuning", None)
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = stage
        cfg["train_micro_batch_size_per_gpu"] = mbs
        cfg["gradient_accumulation_steps"] = self.gas
        cfg["train_batch_size"] = mbs * self.gas * self.dp_world_size
        return cfg

    def _mbs_name(self, stage: int, mbs: int) -> str:
        return f"z{stage}_mbs{mbs}_gas{self.gas}"

    def _experiment(self, name: str, config: dict, space: str, kind=None) -> Experiment:
        exp = Experiment(name=name, ds_config=config, num_nodes=self.num_nodes,
                         num_slots=self.slots_per_node, space=space, kind=kind or ExperimentKind.MBS)
        if self.memory is not None:
            exp.memory_bytes = self.memory.bytes_per_device(config)
        return exp

    def _profile_config(self) -> dict[str, Any]:
        return profile_config(self.user_config, self.at.min_train_micro_batch_size_per_gpu, self.gas, self.dp_world_size)

    def _memory_model(self, info: ModelInfo) -> MemoryModel:
        """The memory model for the profiled model; on CPU calibrated to the profile run's peak."""
        memory = MemoryModel(info.num_params, info.activation_mem_per_gpu, self.dp_world_size, self.at.mp_size)
        if self.cpu and info.peak_memory_bytes:
            memory = memory.calibrated(self._profile_config(), info.peak_memory_bytes,
                                       mbs=self.at.min_train_micro_batch_size_per_gpu)
        return memory

    def _profile(self) -> None:
        cfg = self._profile_config()
        (exp,) = self.scheduler.run([self._experiment("profile", cfg, "profile", ExperimentKind.PROFILE)])
        if exp.status != Status.OK:
            raise TuningFailed(f"the profile run failed ({exp.status.value}: {exp.error}); "
                               f"see {self.exps_dir / 'profile'}")
        info = read_model_info(self.exps_dir / "profile" / "model_info.json", exp.peak_memory_bytes)
        self.model_info = info
        self.memory = memory = self._memory_model(info)
        self.console.print(f"[bold]profile[/]: {info.num_params:,} parameters, activations "
                           f"{format_bytes(info.activation_mem_per_gpu)} per sample, per-rank overhead "
                           f"{format_bytes(memory.overhead_bytes)}, budget {format_bytes(self.device_memory)} per rank")

    def _max_mbs_bound(self) -> int:
        hi = self.at.max_train_micro_batch_size_per_gpu
        if self.at.max_train_batch_size:
            hi = min(hi, self.at.max_train_batch_size // (self.gas * self.dp_world_size))
        return hi

    def _max_mbs_estimate(self, memory: MemoryModel, stage: int, lo: int, hi: int) -> int:
        """The memory model's largest mbs for ``stage`` within the budget (at most ``hi``; below
        ``lo`` when the stage does not fit)."""
        return memory.max_mbs(self._base_config(stage, lo), self.device_memory, cap=hi)

    def _explore(self) -> None:
        lo, hi = self.at.min_train_micro_batch_size_per_gpu, self._max_mbs_bound()
        if hi < lo:
            raise ConfigError(f"{self.config_path}: max_train_batch_size {self.at.max_train_batch_size} leaves no mbs >= "
                              f"{lo} with gas {self.gas} and DP world size {self.dp_world_size}")
        plans = []
        for stage in self.stages:
            est = self._max_mbs_estimate(self.memory, stage, lo, hi)
            plans.append(StagePlan(stage, est))
            self.console.print(f"memory model: ZeRO stage {stage}: "
                               + (f"largest mbs estimated to fit {est}" if est >= lo else
                                  f"does not fit ({format_bytes(self.memory.bytes_per_device(self._base_config(stage, lo)))}"
                                  f" per rank at mbs={lo}): pruned"))

        def evaluate(stage: int, mbs_values: Sequence[int]) -> list[Point]:
            exps = [self._experiment(self._mbs_name(stage, m), self._base_config(stage, m), f"z{stage}")
                    for m in mbs_values]
            return [Point(e.mbs, e.status, e.metric) for e in self.scheduler.run(exps)]

        self.stage_results = explore_stages(evaluate, plans, lo=lo, hi=hi, objective=self.objective,
                                            threshold=PLATEAU_THRESHOLD,
                                            num_fine=self.at.num_tuning_micro_batch_sizes)
        for r in self.stage_results:
            self.console.print(f"ZeRO stage {r.stage}: {r.decision} ({r.reason})"
                               + (f", stopped: {r.trace.stop}" if r.trace.stop else ""))

    def _knob_stages(self) -> list[tuple[int, Point]]:
        """Stages whose knobs are tuned: the best stage, and another within 5% of it."""
        tops = [(r.stage, r.trace.best(self.objective)) for r in self.stage_results if r.decision == "explored"]
        tops = [(s, p) for s, p in tops if p is not None]
        if not tops:
            return []
        tops.sort(key=lambda sp: sp[1].metric, reverse=self.objective.higher_is_better)
        best = tops[0][1].metric
        return [tops[0]] + [(s, p) for s, p in tops[1:2] if abs(self.objective.gain(p.metric, best)) <= 0.05]

    def _knob_space(self, stage: int, mbs: int, memory: MemoryModel | None) -> list[Candidate]:
        """The knob phase's candidates for ``stage`` at ``mbs``: zerotune's default space for the
        stage with the user's own settings, and the user's lists of candidates, over it."""
        user = {k: v for k, v in self.user_config.items()
                if k not in ("autotuning", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "train_batch_size")}
        user_zero = {k: v for k, v in (user.get("zero_optimization") or {}).items() if k != "stage"}
        space = default_space(stage)
        space["zero_optimization"].update(user_zero)
        space.update({k: v for k, v in user.items() if k != "zero_optimization"})
        fits = None if memory is None else (lambda c: memory.fits(c, self.device_memory))
        return generate(self._base_config(stage, mbs), space, stage=stage, dp_world_size=self.dp_world_size, fits=fits)

    def _measured_in_mbs_phase(self, stage: int, mbs: int, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The knob-space candidates that are the mbs phase's config at ``stage`` and ``mbs`` (the
        same settings once the keys the stage ignores are pruned)."""
        measured = config_hash(prune(self._base_config(stage, mbs)))
        return [c for c in candidates if config_hash(c.ds_config) == measured]

    def _tune_knobs(self) -> None:
        """The knob phase (``fast: false``): per chosen stage, at its best mbs, walk the stage's tuning
        space (zerotune's defaults with the user's own settings and lists over them) with the
        configured tuner, in batches as large as the slots can run at once."""
        batch_size = self.pool.capacity(self.num_nodes, self.slots_per_node)
        for stage, point in self._knob_stages():
            candidates = self._knob_space(stage, point.mbs, self.memory)
            fitting = sum(c.fits for c in candidates)
            self.console.print(f"knob phase ZeRO stage {stage} at mbs={point.mbs}: {len(candidates)} configs, "
                               f"{fitting} fit the memory model; tuner {self.at.tuner_type}, "
                               f"at most {self.at.tuner_num_trials} trials")
            tuner = make_tuner(self.at.tuner_type, candidates, objective=self.objective,
                               num_trials=self.at.tuner_num_trials, early_stopping=self.at.tuner_early_stopping)
            for c in self._measured_in_mbs_phase(stage, point.mbs, candidates):
                tuner.tell(c.name, Status.OK, point.metric)  # the same config already ran: not again
            while batch := tuner.ask(batch_size):
                exps = [self._experiment(c.name, c.ds_config, f"z{stage}_knobs") for c in batch]
                for c, exp in zip(batch, self.scheduler.run(exps)):
                    tuner.tell(c.name, exp.status, exp.metric)

    # -- the dry run ------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """Every experiment this job may generate, with the memory model's bytes per device and
        whether they fit, without launching anything (``zerotune tune --dry-run``; see
        :mod:`zerotune.report.plan` for what is listed and where the model size comes from).

        Raises:
            ConfigError: a bad tuning space or bounds (as ``tune`` would).
        """
        memory, source = self._known_memory_model()
        lo, hi = self.at.min_train_micro_batch_size_per_gpu, self._max_mbs_bound()
        rows: list[PlannedExperiment] = []

        def row(name: str, phase: str, cfg: dict, knobs: dict | None = None):
            mem = None if memory is None else memory.bytes_per_device(cfg)
            fits = None if mem is None else mem <= self.device_memory  # MemoryModel.fits, from the same bytes
            rows.append(PlannedExperiment(name, phase, cfg["zero_optimization"]["stage"],
                                          cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
                                          knobs or {}, mem, fits, cfg))

        if source != "profile run on disk":
            row("profile", "profile", self._profile_config())
        estimates = {}
        for stage in self.stages:
            est = hi if memory is None else self._max_mbs_estimate(memory, stage, lo, hi)
            estimates[stage] = est
            for m in mbs_ladder(lo, hi, est) or [lo]:
                row(self._mbs_name(stage, m), "mbs", self._base_config(stage, m))
        if not self.at.fast:
            for stage in self.stages:
                if estimates[stage] >= lo:
                    mbs = min(estimates[stage], hi)
                    candidates = self._knob_space(stage, mbs, memory)
                    measured = {c.name for c in self._measured_in_mbs_phase(stage, mbs, candidates)}
                    for c in (c for c in candidates if c.name not in measured):
                        row(c.name, "knobs", c.ds_config, c.knobs)
        return Plan(rows, source, self.device_memory, self.dp_world_size)

    def _known_memory_model(self) -> tuple[MemoryModel | None, str | None]:
        """The memory model without a new profile run: from a finished profile run of the same
        config in the results dir, else from ``autotuning.model_info.num_params``; else None."""
        done = self.scheduler.load(self._experiment("profile", self._profile_config(), "profile", ExperimentKind.PROFILE))
        if done is not None and done.status == Status.OK:
            try:
                info = read_model_info(self.exps_dir / "profile" / "model_info.json", done.peak_memory_bytes)
                return self._memory_model(info), "profile run on disk"
            except (OSError, KeyError, ValueError):
                pass
        given = self.at.model_info or {}
        if "num_params" in given:
            key = "autotuning.model_info"
            num_params = _positive_int(given["num_params"], f"{key}.num_params", self.config_path)
            activations = given.get("activation_mem_per_gpu", 0)
            if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
                raise ConfigError(f"{self.config_path}: '{key}.activation_mem_per_gpu' = {activations!r}: expected "
                                  f"bytes per sample, a non-negative integer")
            return MemoryModel(num_params, activations, self.dp_world_size, self.at.mp_size), key
        return None, None

    # -- results ----------------------------------------------------------------------------------
    def _notes(self) -> list[str]:
        notes = [f"ZeRO stage {r.stage}: {r.decision} - {r.reason}" + (f"; mbs search stopped: {r.trace.stop}"
                                                                          if r.trace.stop else "")
                 for r in self.stage_results]
        if self.memory is not None:
            notes.append(f"memory model: {self.memory.num_params:,} params, {format_bytes(self.memory.activation_bytes_per_sample)}"
                         f" activations/sample, overhead {format_bytes(self.memory.overhead_bytes)}, budget "
                         f"{format_bytes(self.device_memory)} per rank, DP world size {self.dp_world_size}")
        return notes

    def _full_launch(self, config_path: str, master_port: int) -> tuple[dict[str, str], list[str]]:
        """The launcher's environment additions and command to train with ``config_path`` on all
        selected slots."""
        reservation = self.pool.try_reserve(self.num_nodes, self.slots_per_node)
        try:
            return launch_env(self.spec, reservation), launch_command(self.spec, reservation, config_path, master_port)
        finally:
            self.pool.release(reservation)

    def optimal_command(self, config_path: str) -> str:
        """The ``deepspeed`` command that trains with ``config_path`` on all selected slots."""
        return paste_command(*self._full_launch(config_path, master_port=29500))

    def write_optimal_config(self) -> Experiment | None:
        """Write ``summary.txt``, ``ds_config_optimal.json`` and ``cmd_optimal.txt``; return the best."""
        experiments = [e for e in self.scheduler.history]
        return results_mod.write_results(self.results_dir, experiments, self.objective, self.elapsed_s,
                                         self.scheduler.launched, self.optimal_command, self._notes())

    def print_tuning_results(self) -> None:
        """Print the summary table (the same as ``summary.txt``)."""
        self.console.print(results_mod.render_table(self.scheduler.history, self.objective, self.elapsed_s,
                                                    self.scheduler.launched, self._notes()))
        if self.best is not None:
            self.console.print(f"optimal config: {self.results_dir / 'ds_config_optimal.json'}\n"
                               f"command:        {(self.results_dir / 'cmd_optimal.txt').read_text().strip()}")

    def run_after_tuning(self) -> int:
        """Launch the training with the optimal config (the ``cmd_optimal.txt`` command); its exit code."""
        if self.best is None:
            raise TuningFailed("no optimal configuration to run")
        config_path = str((self.results_dir / "ds_config_optimal.json").resolve())
        env, cmd = self._full_launch(config_path, master_port=free_port())
        self.console.print(f"[bold]running[/]: {paste_command(env, cmd)}")
        env = {**os.environ, **env}
        return subprocess.call(cmd, env=env)


def first_candidates(config: Any, path: str = "") -> Any:
    """A copy of ``config`` where each list of candidates (a tuning-space key) is its first candidate.

    Lists that are DeepSpeed settings themselves (``optimizer.params.betas``...) are kept.
    """
    if isinstance(config, dict):
        return {k: first_candidates(v, f"{path}.{k}" if path else k) for k, v in config.items()}
    if isinstance(config, list) and config and not is_list_valued(path):
        return copy.deepcopy(config[0])
    return copy.deepcopy(config)


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: '{key}' = {value!r}: expected a positive integer")
    return value


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def _cuda_memory() -> int | None:
    import torch
    return int(torch.cuda.get_device_properties(0).total_memory)
