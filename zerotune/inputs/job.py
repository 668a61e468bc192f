"""The tuning job: every input resolved once, before anything runs.

`Job.build` builds a `Job` from what the ``deepspeed`` launcher's user gives (the script, its arguments carrying the
ds_config, the selected device slots) and `TuneOptions`, for the CLI and the Python API alike. It is frozen: the
strategy, the config builder, the scheduler and the results all read the same resolved values, and every bad input is
a `zerotune.core.errors.ConfigError` here, before the first launch (the checks are in `zerotune.inputs.checks`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from zerotune.core.errors import ConfigError
from zerotune.core.launch import LaunchSpec, Node
from zerotune.core.objective import Objective
from zerotune.core.stopping import StopRule
from zerotune.core.units import format_bytes
from zerotune.deepspeed import auto
from zerotune.deepspeed import config as ds_file
from zerotune.deepspeed.args import check_mapped_keys, parse_arg_mappings
from zerotune.deepspeed.keys import CHECKPOINTING
from zerotune.deepspeed.validate import check_sections
from zerotune.inputs import checks as job_checks
from zerotune.inputs.batch import BatchSemantics
from zerotune.inputs.budget import LaunchBudget
from zerotune.inputs.options import LongestOptions, TuneOptions
from zerotune.inputs.variables import first_values, parse_variables, substitute
from zerotune.launchers.base import Launcher
from zerotune.launchers.contract import DEEPSPEED
from zerotune.model.profile import ModelInfo

# autotuning keys DeepSpeed's engine reads that zerotune sets itself for every experiment
_SET_PER_EXPERIMENT = ("enabled", "metric_path", "model_info_path")


@dataclass(frozen=True)
class Job:
    """A tuning job with every input resolved (build it with `build`).

    Attributes:
        script, script_args: the training script and its arguments (with the ds_config flag).
        config_path, user_config: the user's ds_config file and its content (``autotuning`` included; never modified).
        autotuning: the validated ``autotuning`` section.
        nodes: the selected device slots; every experiment runs on all ``num_nodes`` of them, ``slots_per_node`` slots
            each (the smallest count among them), ``world_size`` ranks in all.
        mp_size, dp_world_size: model-parallel size and data-parallel world size (``world_size / mp_size``).
        batch: how mbs, gas and train_batch_size relate (`BatchSemantics`).
        stages: the ZeRO stages to explore, ascending.
        cpu: DeepSpeed runs on CPU (``DS_ACCELERATOR=cpu``, one rank per slot).
        device_memory_bytes: the per-device memory budget, bytes.
        min_mbs, max_mbs, allowed_mbs: the micro batch sizes allowed (`zerotune.inputs.checks.mbs_bounds`) and the
            values within them the search may try (None: all of them).
        model_info: the model's size from ``autotuning.model_info`` (``--dry-run`` without a profile run), or None.
        results_dir, exps_dir, overwrite: where results go, and whether to start fresh.
        stop_rule: when a running experiment may end early (None: never, ``adaptive`` off).
        arg_mappings: ``autotuning.arg_mappings``, checked (`zerotune.deepspeed.args`).
        script_autos: the ``"auto"`` values the script's arguments resolve (`zerotune.deepspeed.auto.script_autos`).
        variables: the ``$VAR`` placeholders' candidates (`zerotune.inputs.variables`).
        notes: what zerotune accepted but does not act on, for the log (never silent).
        checkpointing: the savers phase may try activation checkpointing, through ``arg_mappings[CHECKPOINTING]``.
        autotp_degrees: the AutoTP degrees the savers phase may try beyond the config's (a list's smallest), ascending.
        sp_degrees: likewise the Ulysses degrees (``sequence_parallel_size``) beyond the config's.
        budget: `TuneOptions`' ``max_launches`` and ``max_device_hours``.
        launcher: the user's launcher (`zerotune.launchers`); config_source: where it carries the ds_config.
        The others (timeouts, hostfile, backend, host memory, savers...) are `TuneOptions`' own.
    """

    script: str
    script_args: tuple[str, ...]
    config_path: str
    user_config: dict[str, Any] = field(repr=False)
    autotuning: ds_file.AutotuningConfig = field(repr=False)
    nodes: tuple[Node, ...]
    num_nodes: int
    slots_per_node: int
    world_size: int
    mp_size: int
    dp_world_size: int
    batch: BatchSemantics
    stages: tuple[int, ...]
    cpu: bool
    device_memory_bytes: int
    objective: Objective
    min_mbs: int
    max_mbs: int
    allowed_mbs: tuple[int, ...] | None
    model_info: ModelInfo | None
    results_dir: Path
    exps_dir: Path
    overwrite: bool
    timeout_s: float | None = None
    hang_timeout_s: float | None = None
    hostfile: str | None = None
    backend: str = "local"
    ray_address: str | None = None
    stop_rule: StopRule | None = None
    notes: tuple[str, ...] = ()
    arg_mappings: dict[str, str] = field(default_factory=dict)
    script_autos: dict[str, Any] = field(default_factory=dict)
    variables: dict[str, list[Any]] = field(default_factory=dict)
    host_memory_bytes: int | None = None
    checkpointing: bool = False
    savers: bool = True
    nvme_path: str | None = None
    warm: bool = True
    budget: LaunchBudget = LaunchBudget()
    longest: LongestOptions = LongestOptions()
    launcher: Launcher = Launcher()
    config_source: str = ""
    autotp_degrees: tuple[int, ...] = ()
    sp_degrees: tuple[int, ...] = ()

    @classmethod
    def build(cls, script: str, script_args: Sequence[str], nodes: Sequence[Node],
              options: TuneOptions | None = None, launcher: Launcher | None = None) -> "Job":
        """Resolve every input of a tuning job (``launcher``: the user's, None: ``deepspeed``'s).

        Raises:
            ConfigError: an unreadable or invalid ds_config or ``autotuning`` section, no slots, ``mp_size`` not
                dividing the ranks, no device memory budget on CPU, bounds that leave no micro batch size, or any
                other bad input (`zerotune.inputs.checks`).
        """
        options = options or TuneOptions()
        script_args = tuple(script_args)
        launcher = launcher or Launcher()
        config_path, user, config_source = launcher.load_config(script_args)  # where the launcher carries it
        job_checks.check_candidate_lists(user, config_path)
        at = ds_file.parse_autotuning(user.get("autotuning"), source=config_path)
        mappings = parse_arg_mappings(at.arg_mappings, config_path)
        check_mapped_keys(mappings, user, config_path)
        checkpointing = options.savers and auto.checkpointing_flag(user, script_args, mappings)
        if checkpointing and CHECKPOINTING not in mappings:
            mappings[CHECKPOINTING] = auto.TRAINER_CHECKPOINTING_FLAG
        variables = parse_variables({**(at.variables or {}), **options.variables}, user, config_path)
        autos = auto.script_autos(user, script_args, mappings, config_path)  # a Trainer script's "auto" gas, precision
        notes = _unused_autotuning_notes(user, at)
        num_nodes, slots_per_node = _slots_per_experiment(nodes)
        world_size = num_nodes * slots_per_node
        dp = _dp_world_size(world_size, at.mp_size, config_path)
        sp = job_checks.sequence_parallel_size(user, dp, config_path)
        if len(sp) > 1:  # the smallest degree is every config's (1: DeepSpeed's default, unwritten); the others
            user = {k: v for k, v in user.items() if k != "sequence_parallel_size"}  # are the savers phase's
            user.update({"sequence_parallel_size": sp[0]} if sp[0] > 1 else {})
        batch = _batch_semantics(user, autos, mappings, dp // sp[0], at, config_path)
        cpu = options.cpu if options.cpu is not None else not cuda_available()
        memory = job_checks.device_memory_bytes(options.device_memory_bytes, cpu)
        min_mbs, max_mbs, allowed = job_checks.mbs_bounds(at, batch, config_path)
        job_checks.check_options(options)
        job_checks.check_launcher(launcher, options, nodes)
        results_dir = Path(options.results_dir or at.results_dir)
        stages = tuple(ds_file.stage_candidates(user, source=config_path))
        autotp = job_checks.check_autotp(user, stages, slots_per_node, config_path)
        if len(autotp) > 1:  # the smallest degree is every config's; the others are the savers phase's variants
            user = {**user, "tensor_parallel": {**user["tensor_parallel"], "autotp_size": autotp[0]}}
        concrete = substitute(user, first_values(variables))
        check_sections(concrete, config_path)
        notes += job_checks.check_untunable(concrete, at, batch, min_mbs, config_path)
        host_memory = job_checks.host_memory_bytes(options, cpu, nodes)
        if cpu:
            local_slots = slots_per_node if options.backend == "local" and not options.hostfile else 0
            job_checks.check_cpu_ranks(memory, local_slots)
        job_checks.check_output_dirs(options, at, config_path, results_dir)
        return cls(script=script, script_args=script_args, config_path=config_path, user_config=user,
                   autotuning=at, nodes=tuple(nodes), num_nodes=num_nodes, slots_per_node=slots_per_node,
                   world_size=world_size, mp_size=at.mp_size, dp_world_size=dp, batch=batch, cpu=cpu,
                   stages=stages, device_memory_bytes=memory,
                   objective=Objective.named(at.metric), min_mbs=min_mbs, max_mbs=max_mbs, allowed_mbs=allowed,
                   model_info=job_checks.given_model_info(at, config_path), results_dir=results_dir,
                   exps_dir=results_dir / "exps" if options.results_dir else Path(at.exps_dir),
                   overwrite=options.overwrite if options.overwrite is not None else at.overwrite,
                   timeout_s=options.timeout_s, hang_timeout_s=options.hang_timeout_s, hostfile=options.hostfile,
                   backend=options.backend, ray_address=options.ray_address, notes=notes, arg_mappings=mappings,
                   script_autos=autos, variables=variables, host_memory_bytes=host_memory, checkpointing=checkpointing,
                   autotp_degrees=autotp[1:], sp_degrees=sp[1:],
                   savers=options.savers, nvme_path=options.nvme_path, warm=options.warm,
                   stop_rule=StopRule(Objective.named(at.metric), options.precision) if options.adaptive else None,
                   budget=LaunchBudget(options.max_launches, options.max_device_hours), longest=options.longest,
                   launcher=launcher, config_source=config_source)

    @property
    def capacity_bytes(self) -> int | None:
        """The per-device budget against which a run's measured peak tells how near the device's capacity it
        ran (bytes); None on CPU ranks, where caches, not an allocator's flushes, shape the curve in mbs."""
        return None if self.cpu else self.device_memory_bytes

    def launch_spec(self) -> LaunchSpec:
        """How every experiment launches the script (the backends' input)."""
        return LaunchSpec(script=self.script, script_args=self.script_args, cpu=self.cpu,
                          device_memory_bytes=self.device_memory_bytes, timeout_s=self.timeout_s,
                          hang_timeout_s=self.hang_timeout_s, hostfile=self.hostfile, warm=self.warm,
                          start_profile_step=self.autotuning.start_profile_step,
                          end_profile_step=self.autotuning.end_profile_step, objective=self.objective,
                          stop_rule=self.stop_rule, arg_mappings=tuple(self.arg_mappings.items()),
                          max_steps_arg=self.autotuning.max_steps_arg,
                          launcher=None if self.launcher.name == DEEPSPEED else self.launcher)

    def describe(self) -> str:
        """One line for the log: ranks, DP world size, budget, stages, mbs bounds, objective."""
        return (f"job: {self.num_nodes} node(s) x {self.slots_per_node} rank(s), DP world size {self.dp_world_size}, "
                f"{format_bytes(self.device_memory_bytes)} per device, ZeRO stages {list(self.stages)}, "
                f"mbs {self.min_mbs}..{self.max_mbs}, objective {self.objective.name} ({self.objective.unit}); "
                f"{self.batch.describe()}")


def _unused_autotuning_notes(user: dict[str, Any], at: ds_file.AutotuningConfig) -> tuple[str, ...]:
    """A note for each ``autotuning`` key the user set that zerotune sets itself for every experiment
    (``"enabled": true`` is what zerotune does anyway: no note)."""
    return tuple(f"autotuning.{key} = {getattr(at, key)!r} is not used: zerotune sets it for each experiment"
                 for key in _SET_PER_EXPERIMENT if key in (user.get("autotuning") or {})
                 and not (key == "enabled" and at.enabled))


def _slots_per_experiment(nodes: Sequence[Node]) -> tuple[int, int]:
    """(nodes, slots per node) of every experiment: all the nodes, each with the smallest slot count."""
    if not nodes:
        raise ConfigError("no device slots selected")
    return len(nodes), min(len(n.slots) for n in nodes)


def _dp_world_size(world_size: int, mp_size: int, config_path: str) -> int:
    """The data-parallel world size: ``world_size / mp_size``, which must divide."""
    if world_size % mp_size:
        raise ConfigError(f"{config_path}: 'autotuning.mp_size' = {mp_size} does not divide the "
                          f"{world_size} ranks of each experiment")
    return world_size // mp_size


def _batch_semantics(user: dict[str, Any], autos: dict[str, Any], mappings: dict[str, str], dp: int,
                     at: ds_file.AutotuningConfig, config_path: str) -> BatchSemantics:
    """How mbs, gas and train_batch_size relate, the script's ``"auto"`` values resolved; a Trainer
    script's own batch arguments checked against it."""
    # a Trainer script's gas is its own argument: searched only where it is mapped (or bounded on purpose)
    search_gas = not auto.auto_paths(user) or "gradient_accumulation_steps" in mappings
    batch = BatchSemantics.from_config(auto.resolve(user, autos), dp, at.max_train_batch_size, config_path,
                                       search_gas=search_gas)
    auto.check_trainer_batch(user, mappings, bool(batch.fixed_train_batch_size or batch.gas_ladder(1)), config_path)
    return batch


def cuda_available() -> bool:
    """True when DeepSpeed's ranks would run on a CUDA device (the one place zerotune decides CUDA or CPU): False
    where ``DS_ACCELERATOR=cpu`` (DeepSpeed's own override, which the ranks inherit: they run on CPU whatever torch
    sees), else whether torch sees a CUDA device."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False
