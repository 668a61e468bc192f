"""The checks `zerotune.inputs.job.Job.build` runs on a job's inputs before anything runs: each bad input is a
`zerotune.core.errors.ConfigError` naming the flag or the config file and key, never a failed launch later."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import psutil

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.config import AutotuningConfig
from zerotune.deepspeed.keys import GAS, MBS, TBS, candidate_lists
from zerotune.inputs.batch import BatchSemantics
from zerotune.launchers.base import Launcher
from zerotune.launchers.contract import DEEPSPEED, OWN
from zerotune.model.profile import ModelInfo
from zerotune.run.backends import BACKENDS

__all__ = ["MIN_CPU_RANK_BYTES", "check_autotp", "check_candidate_lists", "check_cpu_ranks", "check_options",
           "check_output_dirs", "check_untunable", "check_writable_dir", "given_model_info", "host_memory_bytes",
           "mbs_bounds", "sequence_parallel_size"]


def check_candidate_lists(user: dict[str, Any], config_path: str) -> None:
    """Every list of candidates in the user's ds_config holds at least one."""
    for key, candidates in candidate_lists(user):
        if not candidates:
            raise ConfigError(f"{config_path}: {key} = []: a list in the config is a list of candidates to tune; "
                              f"expected at least one")


def sequence_parallel_size(user: dict[str, Any], dp: int, source: str) -> tuple[int, ...]:
    """The config's Ulysses degrees ``sequence_parallel_size``, ascending and unique (``(1,)`` without the key): an
    integer, or a non-empty list of them (the savers phase tries the larger ones, D336), read as written. DeepSpeed
    counts a degree's ranks as one data-parallel replica in ``train_batch_size`` (DP world size / degree:
    ``deepspeed/runtime/config.py``, ``DeepSpeedConfig.__init__``), while ZeRO still partitions over every rank (D331).

    Raises:
        ConfigError: a degree that is not a positive integer (a ``$VAR`` placeholder of degrees is not searched), or
            that does not divide the DP world size.
    """
    value = user.get("sequence_parallel_size", 1)
    listed = value if isinstance(value, list) and value else [value]
    for sp in listed:
        if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
            raise ConfigError(f"{source}: 'sequence_parallel_size' = {value!r}: expected a positive integer or a "
                              f"list of them")
        if dp % sp:
            raise ConfigError(f"{source}: 'sequence_parallel_size' = {value!r}: {sp} does not divide the DP world "
                              f"size {dp} of each experiment")
    return tuple(sorted(set(listed)))


def check_autotp(user: dict[str, Any], stages: Sequence[int], slots_per_node: int, source: str) -> tuple[int, ...]:
    """The ``tensor_parallel.autotp_size`` degrees to tune, ascending and unique (``()`` without the key): an integer,
    or a non-empty list of them (the savers phase tries the larger ones, D334). Each t > 1 divides each experiment's
    ranks on a node (AutoTP's groups), and no candidate stage is 3 then: at stages 0-2 DeepSpeed counts every rank in
    ``train_batch_size``, at stage 3 ranks / t (D331). Read from the user's config as written.

    Raises:
        ConfigError: a ``$VAR`` placeholder, a value that is not a non-negative integer, a degree over 1 that does
            not divide the ranks on a node, or one with ZeRO stage 3 among the candidates; naming the key.
    """
    section = user.get("tensor_parallel")
    value = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    listed = value if isinstance(value, list) and value else [value]
    for tp in listed:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 0:
            raise ConfigError(f"{source}: 'tensor_parallel.autotp_size' = {value!r}: expected a non-negative integer "
                              f"or a list of them")
        if tp > 1 and slots_per_node % tp:
            raise ConfigError(f"{source}: 'tensor_parallel.autotp_size' = {value!r}: {tp} does not divide the "
                              f"{slots_per_node} rank(s) each experiment runs on a node")
        if tp > 1 and 3 in stages:
            raise ConfigError(f"{source}: 'tensor_parallel.autotp_size' = {value!r} with ZeRO stage 3 among the "
                              f"candidates {list(stages)}: DeepSpeed counts ranks / autotp_size in train_batch_size at "
                              f"stage 3 and every rank at stages 0-2; zerotune tunes AutoTP at stages 0-2 "
                              f"(set zero_optimization.stage)")
    return tuple(sorted(set(listed))) if isinstance(section, dict) and "autotp_size" in section else ()


MAX_TIMEOUT_S = 1e7
"""The longest ``--timeout``/``--hang-timeout``, seconds: below 1 s no DeepSpeed run starts, and above this a
timeout is a typo (``1e308``), not a limit."""


def check_options(options: Any) -> None:
    """zerotune's own options (a `zerotune.inputs.job.TuneOptions`): a known backend, a
    precision between 0 and 1, timeouts from 1 s to `MAX_TIMEOUT_S`, an ``--nvme-path`` that is a directory."""
    if options.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {options.backend!r}: expected 'local', 'ray' or 'slurm'")
    if not 0 < options.precision < 1:
        raise ConfigError(f"--precision {options.precision:g}: expected a relative half-width between 0 and 1, "
                          "e.g. 0.02 for ±2%")
    for flag, value in (("--timeout", options.timeout_s), ("--hang-timeout", options.hang_timeout_s)):
        if value is not None and not 1 <= value <= MAX_TIMEOUT_S:
            raise ConfigError(f"{flag} {value:g}: expected seconds from 1 to {MAX_TIMEOUT_S:,.0f} (about 115 days)")
    if options.nvme_path is not None and not os.path.isdir(options.nvme_path):
        raise ConfigError(f"--nvme-path {options.nvme_path}: not a directory (expected one on local NVMe)")


def check_launcher(launcher: Launcher, options: Any, nodes: Sequence[Any]) -> None:
    """Where the user's launcher can run: a script that starts its own ranks only on the local backend (every other
    backend starts each rank itself); a launcher other than ``deepspeed`` on one node, or on several through Slurm's
    job steps (DeepSpeed's runner, which the local and Ray backends use across nodes, starts only its own form)."""
    if launcher.contract == OWN and options.backend != "local":
        raise ConfigError(f"{launcher.describe('SCRIPT')}: the script starts its own ranks, and --backend "
                          f"{options.backend} starts every rank itself: launch it with torchrun or deepspeed")
    if launcher.name != DEEPSPEED and options.backend != "slurm" and any(n.host != "localhost" for n in nodes):
        raise ConfigError(f"{launcher.name}: zerotune runs a {launcher.name} job's experiments on this machine, or "
                          "on several nodes with --backend slurm; across hosts of a hostfile use the deepspeed form")


def mbs_bounds(at: AutotuningConfig, batch: BatchSemantics, source: str) -> tuple[int, int, tuple[int, ...] | None]:
    """(smallest, largest, allowed) mbs: the per-GPU bounds narrowed by the train batch bounds (train_batch_size =
    mbs * gas * DP) or a fixed train_batch_size, and the values the batch semantics allow within them (None: any)."""
    lo = at.min_train_micro_batch_size_per_gpu
    if batch.fixed_train_batch_size is None:
        lo = max(lo, -(-at.min_train_batch_size // (batch.gas * batch.dp_world_size)))
    hi = batch.max_mbs(at.max_train_micro_batch_size_per_gpu)
    allowed = batch.allowed_mbs(lo, hi)
    if hi < lo or allowed == ():
        raise ConfigError(f"{source}: the autotuning bounds leave no micro batch size: mbs {lo}..{hi} "
                          f"(min/max_train_micro_batch_size_per_gpu = {at.min_train_micro_batch_size_per_gpu}/"
                          f"{at.max_train_micro_batch_size_per_gpu}, min/max_train_batch_size = "
                          f"{at.min_train_batch_size}/{at.max_train_batch_size}; {batch.describe()})")
    return (allowed[0], allowed[-1], allowed) if allowed else (lo, hi, None)


def given_model_info(at: AutotuningConfig, source: str) -> ModelInfo | None:
    """``autotuning.model_info`` (``num_params``, optional ``activation_mem_per_gpu``) as a ModelInfo."""
    given = at.model_info or {}
    if "num_params" not in given:
        return None
    key = "autotuning.model_info"
    num_params = _positive_int(given["num_params"], f"{key}.num_params", source)
    activations = given.get("activation_mem_per_gpu", 0)
    if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
        raise ConfigError(f"{source}: '{key}.activation_mem_per_gpu' = {activations!r}: expected bytes per sample, "
                          f"a non-negative integer")
    trainable = _positive_int(given.get("trainable_num_params", num_params), f"{key}.trainable_num_params", source)
    return ModelInfo(num_params, trainable, activations)


def _positive_int(value: Any, key: str, source: str, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: '{key}' = {value!r}: expected a positive integer{why}")
    return value


MIN_CPU_RANK_BYTES = 256 * 2**20
"""The smallest per-rank budget on CPU: a rank's Python with torch and DeepSpeed imported holds
about 195 MiB of private data (``VmData``, what ``RLIMIT_DATA`` limits) before any model."""


def check_untunable(user: dict[str, Any], at: AutotuningConfig, batch: BatchSemantics, min_mbs: int,
                     source: str) -> tuple[str, ...]:
    """Refuse inputs no experiment could honour: a fixed train batch or gas candidates outside the ``autotuning``
    bounds (``user`` with its ``$VAR`` placeholders substituted). Return the notes for the log: a fixed
    train_batch_size that disagrees with the config's mbs and gas (which the search replaces) is said, not hidden."""
    dp, notes = batch.dp_world_size, []
    tbs, mbs, gas = (user.get(k) for k in (TBS, MBS, GAS))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (tbs, mbs, gas)):
        if tbs != mbs * gas * dp:
            notes.append(f"{source}: '{TBS}' = {tbs} disagrees with {MBS} {mbs} x {GAS} {gas} x DP world size {dp} "
                         f"= {mbs * gas * dp}: the train batch size is held fixed at {tbs}, so gas follows each "
                         f"mbs tried ({tbs} = mbs x gas x {dp})")
    if isinstance(tbs, int) and not isinstance(tbs, bool):
        for key, bound, bad in (("max_train_batch_size", at.max_train_batch_size, lambda b: tbs > b),
                                ("min_train_batch_size", at.min_train_batch_size, lambda b: tbs < b)):
            if bound is not None and bad(bound):
                raise ConfigError(f"{source}: '{TBS}' = {tbs} is outside 'autotuning.{key}' = {bound}")
    if at.max_train_batch_size is not None:
        for g in batch.gas_values:
            if min_mbs * g * dp > at.max_train_batch_size:
                raise ConfigError(f"{source}: '{GAS}' candidate {g} gives train_batch_size {min_mbs * g * dp} "
                                  f"(mbs {min_mbs} x gas {g} x DP {dp}) above 'autotuning.max_train_batch_size' = "
                                  f"{at.max_train_batch_size}")
    return tuple(notes)


def check_cpu_ranks(budget_bytes: int, local_ranks: int) -> None:
    """On CPU: a budget that can start a rank, and no more local ranks than this process may use
    cores (``local_ranks`` 0: not a local run, not checked)."""
    from zerotune.core.units import format_bytes
    if budget_bytes < MIN_CPU_RANK_BYTES:
        raise ConfigError(f"--device-memory {format_bytes(budget_bytes)}: too small to start a CPU rank (Python "
                          f"with torch and DeepSpeed needs about 200 MiB before the model); at least "
                          f"{format_bytes(MIN_CPU_RANK_BYTES)}")
    cores = len(os.sched_getaffinity(0))
    if local_ranks > cores:
        raise ConfigError(f"--num_gpus {local_ranks}: on CPU each slot is one rank process, and this machine gives "
                          f"zerotune {cores} core(s); at most {cores}")


def check_output_dirs(options: Any, at: AutotuningConfig, config_path: str, results_dir: Path) -> None:
    """The results directory, and the experiments directory unless it lies inside it (``--results-dir``
    given), can be made (`check_writable_dir`), each named by the flag or key that set it."""
    for flag, path in (("--results-dir" if options.results_dir else f"{config_path}: 'autotuning.results_dir'",
                        results_dir),
                       (f"{config_path}: 'autotuning.exps_dir'", None if options.results_dir else Path(at.exps_dir))):
        check_writable_dir(flag, path)


def check_writable_dir(what: str, path: Path | None) -> None:
    """``path`` is a directory or can be made one: it resolves (no symlink loop, no dangling symlink), neither it nor
    an ancestor is a file, and its nearest existing ancestor is writable (checked, nothing created)."""
    if path is None:
        return
    try:
        path.resolve()
    except (RuntimeError, OSError) as e:  # Python 3.11 raises RuntimeError on a symlink loop
        raise ConfigError(f"{what} {str(path)!r}: it never resolves to a directory ({e}): a symlink loop") from None
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{what} {str(path)!r}: a symlink to {os.readlink(path)!r}, which is not there: expected a "
                          "directory or a path zerotune can create")
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what} {str(path)!r}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r}: {probe} is not writable")


def host_memory_bytes(options: Any, cpu: bool, nodes: Sequence[Any]) -> int | None:
    """Host memory per node for offload: ``--host-memory``, else this machine's memory when every node is
    this machine with CUDA devices and the local backend, else None (not checked)."""
    host_memory = options.host_memory_bytes
    if host_memory is None and not cpu and options.backend == "local" and all(n.host == "localhost" for n in nodes):
        host_memory = int(psutil.virtual_memory().total)
    return host_memory


def device_memory_bytes(given: int | None, cpu: bool) -> int:
    """The per-device budget: ``given`` (``--device-memory``), else the CUDA device's memory.

    Raises:
        ConfigError: none is given on CPU ranks.
    """
    if given:
        return given
    if cpu:
        raise ConfigError("--device-memory is required on a machine without CUDA (the per-rank budget, e.g. 3GiB)")
    import torch
    return int(torch.cuda.get_device_properties(0).total_memory)
