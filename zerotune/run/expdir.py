"""The experiment directory ``<exps_dir>/<name>/``: DeepSpeed's autotuning protocol, a run's files, its outcome.


A backend calls `prepare` just before it launches (``ds_config.json`` with the ``autotuning`` section that makes
DeepSpeed's engine measure and exit) and `finish` once the run's processes are gone; in between it only supervises
processes, whose output goes to ``stdout.log`` and ``stderr.log`` (the launch line to ``cmd.txt``). The directory also
holds DeepSpeed's result file (`result_path`), the probe's ``probe.rank*.jsonl`` (`zerotune.probe`) and the
scheduler's ``exp.json`` (`zerotune.run.store`). The outcome is decided from facts (`classify`), never from log words.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import activation_slope_bytes, measure, peak_bytes, seen_seq_lens
from zerotune.core.objective import Objective
from zerotune.core.stopping import EndReason
from zerotune.deepspeed.auto import read_engine_record
from zerotune.model.profile import CHECKPOINTED_ACTIVATIONS_KEY, SAVED_ACTIVATIONS_KEY
from zerotune.model.zero_options import ZeroOptions
from zerotune.probe import (
    PAD_FILE,
    clear_streams,
    read_checkpointed_activations,
    read_model_shapes,
    read_saved_activations,
    read_streams,
)
from zerotune.run.store import read_object, write_json_atomic, write_text_atomic

__all__ = [
    "CMD_FILE", "CONFIG_FILE", "METRICS_FILE", "MODEL_INFO_FILE", "OOM_PATTERNS", "STDERR_LOG", "STDOUT_LOG",
    "classify", "file_size", "finish", "output_bytes", "prepare", "result_path",
]

CONFIG_FILE = "ds_config.json"
CMD_FILE = "cmd.txt"
STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"
METRICS_FILE = "metrics.json"
MODEL_INFO_FILE = "model_info.json"

PROFILE_KEY = "num_params"  # the key of model_info.json that says the profile run succeeded
LOG_TAIL_BYTES = 200_000  # of each log, read to classify a failure

# What to check when a run exited 0 without its result file.
_MISSING_HINT = {
    METRICS_FILE: "does the script run more than end_profile_step steps?",
    MODEL_INFO_FILE: "does the script run a forward step through the DeepSpeed engine?",
}


def result_path(exp: Experiment, exp_dir: Path) -> Path:
    """The file DeepSpeed's engine writes as ``exp``'s result: ``model_info.json`` for the profile run (written in its
    first forward: ``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu``), else ``metrics.json`` (rank 0,
    at ``end_profile_step``: ``latency`` in microseconds per step, ``throughput`` in samples/s, ``FLOPS_per_gpu``)."""
    return Path(exp_dir) / (MODEL_INFO_FILE if exp.kind is ExperimentKind.PROFILE else METRICS_FILE)


def prepare(exp: Experiment, exp_dir: Path, objective: Objective, start_profile_step: int,
            end_profile_step: int) -> Path:
    """Make ``exp_dir`` ready for a launch of ``exp``.

    Creates the directory, removes an earlier attempt's result files and probe streams (a stale file is never read
    as this run's result) and writes ``ds_config.json``: ``exp.ds_config`` (not modified) plus the ``autotuning``
    section (``metric`` from ``objective``, result paths inside ``exp_dir``, the engine measuring from
    ``start_profile_step`` and exiting after ``end_profile_step``); with ``exp.pad_seq_len``, also the probe's pad
    file (`zerotune.probe.PAD_FILE`).

    Returns:
        The absolute path of the config written, for the launcher's ds_config argument.
    """
    exp_dir = Path(exp_dir).resolve()
    exp_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, model_info_path = exp_dir / METRICS_FILE, exp_dir / MODEL_INFO_FILE
    for stale in (metrics_path, model_info_path):
        stale.unlink(missing_ok=True)
    clear_streams(exp_dir)  # the step probe appends
    pad_path = exp_dir / PAD_FILE  # the length the probe pads every batch to (--verify-longest), or none
    if exp.pad_seq_len:
        write_text_atomic(pad_path, f"{int(exp.pad_seq_len)}\n")
    else:
        pad_path.unlink(missing_ok=True)
    config = json.loads(json.dumps(exp.ds_config))
    config.setdefault("autotuning", {}).update(
        enabled=True, metric_path=str(metrics_path), model_info_path=str(model_info_path),
        start_profile_step=start_profile_step, end_profile_step=end_profile_step, metric=objective.name)
    config_path = exp_dir / CONFIG_FILE
    write_json_atomic(config_path, config)
    return config_path


def finish(exp: Experiment, exp_dir: Path, objective: Objective, exit_code: int | None, timed_out: bool = False,
           interrupted: bool = False, ended: EndReason | None = None) -> Experiment:
    """Fill in ``exp``'s outcome (in place) from its directory, once the run's processes are gone; returns ``exp``.

    Sets ``status`` and ``error`` (`classify` on the result file and the logs' tails), ``exit_code``, ``metrics``
    (the result file's content; for the profile run also the probe's ``activation_saved_bytes``, shapes and, where
    it priced checkpointing, ``activation_checkpointed_bytes``) and ``metric`` (in ``objective``'s unit; None unless
    OK, and for the profile run).

    An OK run's metric is the step probe's (`zerotune.core.measure.measure`, ``metric_source`` "probe", with
    ``metric_rel_half_width`` and ``boundary_share``) when the streams hold a steady step on every rank, else
    DeepSpeed's (``metric_source`` "deepspeed": flops, no streams, too few steps). Recorded peaks set
    ``peak_memory_bytes`` (largest rank; else the backend's value stays); on CUDA ``activation_slope_bytes`` is the
    run's growth per sample (`zerotune.core.measure.activation_slope_bytes`), else None; ``max_seq_len_seen`` and
    ``min_seq_len_seen`` come from `zerotune.core.measure.seen_seq_lens` (times a Ulysses degree: whole sequences).

    Args:
        exit_code: the launcher's exit status (None if it never started).
        timed_out: the backend killed the run for its timeout or a hang (it may refine ``error`` afterwards).
        interrupted: the tuner was interrupted; a run without a result is then INTERRUPTED (re-run on resume).
        ended: a reason with `EndReason.by_rule` when the backend ended the run on its
            `zerotune.core.stopping.StopRule`: the run is OK with the probe's metric though DeepSpeed wrote no
            ``metrics.json``. Otherwise ``exp.ended`` is derived: STEP_CAP (result file), STOPPED (timeout,
            interruption) or EXITED.
    """
    path = result_path(exp, exp_dir)
    data, invalid = read_object(path)
    profile = exp.kind is ExperimentKind.PROFILE
    streams = read_streams(exp_dir)
    probed = None if profile else measure(streams, objective)  # measured once: the profile run has no metric
    early = probed if ended is not None and ended.by_rule else None
    exp.exit_code = exit_code
    if early is not None:
        exp.status, exp.error = Status.OK, ""
    elif interrupted and data is None:
        exp.status, exp.error = Status.INTERRUPTED, "the tuner was interrupted"
    else:
        exp.status, exp.error = classify(exit_code, data, PROFILE_KEY if profile else objective.metric_key,
                                         _logs(Path(exp_dir)), timed_out, result_file=path.name, invalid=invalid)
        if exp.status is Status.FAILED and not Path(exp_dir).is_dir():  # not the config's failure: its files went
            exp.error = (f"exit code {exit_code}: its directory {exp_dir} was removed while it ran, its logs and "
                         f"results with it")
    exp.metrics = data or {}
    saved = read_saved_activations(exp_dir) if profile and data else None
    if saved is not None:
        exp.metrics[SAVED_ACTIVATIONS_KEY] = saved
    if profile and data:
        exp.metrics.update(read_model_shapes(exp_dir))
        checkpointed = read_checkpointed_activations(exp_dir)
        if checkpointed is not None:
            exp.metrics[CHECKPOINTED_ACTIVATIONS_KEY] = checkpointed
    exp.metric = objective.read(exp.metrics) if exp.status is Status.OK and not profile and data else None
    exp.metric_source, exp.metric_rel_half_width = ("deepspeed" if exp.metric is not None else ""), None
    exp.boundary_share = exp.steady_steps = exp.tokens_per_s = None
    measured = probed if early is not None or exp.metric is not None else None
    if measured is not None:
        exp.metric, exp.metric_rel_half_width, exp.metric_source = measured.value, measured.rel_half_width, "probe"
        exp.boundary_share, exp.steady_steps = measured.boundary_share, measured.steady_steps
        exp.tokens_per_s = measured.tokens_per_s
    if early is not None:
        exp.ended = ended.value
    elif exp.status is Status.OK:
        exp.ended = EndReason.STEP_CAP.value
    else:
        exp.ended = (EndReason.STOPPED if timed_out or exp.status is Status.INTERRUPTED else EndReason.EXITED).value
    peaks = probed.peak_bytes if probed is not None else peak_bytes(streams)  # the measurement holds them
    if peaks:
        exp.peak_memory_bytes = max(peaks.values())
    mbs = exp.ds_config.get("train_micro_batch_size_per_gpu")
    exp.activation_slope_bytes = (activation_slope_bytes(streams, mbs) if isinstance(mbs, int) and not profile
                                  else None)
    sp = ZeroOptions.of(exp.ds_config).sp  # a Ulysses rank holds 1/sp of each sequence: lengths are whole ones
    exp.max_seq_len_seen, exp.min_seq_len_seen = (n * sp if n else n for n in seen_seq_lens(streams))
    _check_ulysses(exp, Path(exp_dir))
    return exp


def _check_ulysses(exp: Experiment, exp_dir: Path) -> None:
    """Fail an OK run whose config sets a Ulysses degree its engine did not run with (`ulysses_refused`)."""
    error = ulysses_refused(exp, exp_dir) if exp.status is Status.OK else None
    if error is not None:
        exp.status, exp.metric, exp.metric_source, exp.error = Status.FAILED, None, "", error


def ulysses_refused(exp: Experiment, exp_dir: Path) -> str | None:
    """Why ``exp``'s Ulysses degree (``sequence_parallel_size``) does not fit the script or the model, or None (no
    degree over 1, or nothing says so): the probe's engine record says the engine ran with another degree, as when the
    script passes DeepSpeed no sequence-parallel mpu (each rank trained whole sequences while ``train_batch_size``
    counted its group as one replica, so its samples/s are that degree too low, D336); or a rank raised DeepSpeed's
    refusal of a degree that does not divide the model's attention or key/value heads (`_HEADS_REFUSED`,
    ``UlyssesSPAttentionHF.__init__``)."""
    sp = ZeroOptions.of(exp.ds_config).sp
    if sp > 1 and exp.status is not Status.OK:
        heads = next((line for kind, line in _raised_errors(_logs(Path(exp_dir))) if _HEADS_REFUSED.search(line)), None)
        if heads is not None:
            return (f"sequence_parallel_size {sp}: DeepSpeed's Ulysses refused the model: "
                    f"{_HEADS_REFUSED.search(heads).group(0)}: list only degrees that divide its attention heads "
                    f"(and its key/value heads, or that they divide)")
    record = read_engine_record(exp_dir) if sp > 1 else None
    engine_sp = record.get("sequence_parallel_size") if record else None
    if not isinstance(engine_sp, int) or engine_sp == sp:
        return None
    return (f"sequence_parallel_size {sp}: the script's DeepSpeed engine ran with a sequence-parallel group of "
            f"{engine_sp}: the script does not take Ulysses (it must pass deepspeed.initialize the mpu of "
            f"UlyssesSPAttentionHF.register_with_transformers, or use Accelerate's ParallelismConfig), so each rank "
            f"trained whole sequences; drop the key or list only 1")


def output_bytes(exp_dir: Path) -> int:
    """Bytes printed so far to ``stdout.log`` and ``stderr.log``; its growth tells a busy run from a hung one."""
    return sum(file_size(Path(exp_dir) / name) for name in (STDOUT_LOG, STDERR_LOG))


# The allocators' own out-of-memory errors (torch's CPU and CUDA allocators, other devices', NCCL's CUDA
# calls, C++ ``new``, Python, the kernel's ENOMEM, ``dlopen`` under a memory limit, OpenMP's thread stacks: glibc's
# EAGAIN when a stack cannot be mapped, met under RLIMIT_DATA on CPU ranks, D334), matched only in the
# exceptions the ranks raised (`_raised_errors`), never in other log lines: "read 4096 samples out of
# memory-mapped shards" is a log line, and a FileNotFoundError after it is no OOM.
OOM_PATTERNS = re.compile(
    r"DefaultCPUAllocator: can't allocate memory|(CUDA|HIP|XPU|MPS)( backend)? out of memory|"
    r"CUDA error: out of memory|Cuda failure '?out of memory|cudaErrorMemoryAllocation|"
    r"(CUBLAS|CUDNN)_STATUS_ALLOC_FAILED|std::bad_alloc|\bMemoryError\b|Cannot allocate memory|"
    r"failed to map segment from shared object|^libgomp: Thread creation failed: Resource temporarily unavailable")
# An exception's type that is itself an out-of-memory error (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError,
# c10::OutOfMemoryError, Python's MemoryError).
_OOM_TYPE = re.compile(r"(^|[.:])(OutOfMemoryError|MemoryError)$")
# A line stating a raised exception, as Python prints an uncaught one (``Type: message``, or ``Type`` alone,
# unindented, after an optional ``[rank0]:`` prefix), or as C++ reports one (``terminate called after throwing an
# instance of 'Type'``, then ``what():  message``), or as the interpreter or OpenMP's runtime reports a fatal error.
_RAISED = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?)?(?:(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))"
                     r"(?::\s.*)?|terminate called after throwing an "
                     r"instance of '(?P<cxx>[^']+)'.*|\s*what\(\):\s+.*|(?P<fatal>Fatal Python error|libgomp): .*)\s*$")
# DeepSpeed's refusal of a Ulysses degree the model's heads do not take (``deepspeed/runtime/sequence_parallel/
# ulysses_sp.py``, ``UlyssesSPAttentionHF.__init__``).
_HEADS_REFUSED = re.compile(r"(KV )?[Aa]ttention head count \d+ is not divisible by SP size \d+( or vice versa)?")
# What the deepspeed launcher raises when a rank exited non-zero: a report of the failure, not its cause.
_LAUNCHER_ERRORS = ("subprocess.CalledProcessError", "CalledProcessError")


def _raised_errors(log_text: str) -> list[tuple[str, str]]:
    """The exceptions the logs show raised, in order: ``(type, the line stating it)``; a C++ ``what()`` line takes
    the type of the ``terminate`` line before it. The launcher's own ``CalledProcessError`` is left out."""
    raised, cxx = [], ""
    for line in log_text.splitlines():
        m = _RAISED.match(line)
        if not m:
            continue
        kind = m.group("type") or m.group("cxx") or m.group("fatal") or cxx
        cxx = m.group("cxx") or ""
        if kind and kind not in _LAUNCHER_ERRORS:
            raised.append((kind, line.strip()))
    return raised


def _is_oom(kind: str, line: str) -> bool:
    """Whether a raised exception's type or message (`OOM_PATTERNS`) says it is an allocator's out-of-memory error."""
    return bool(_OOM_TYPE.search(kind) or OOM_PATTERNS.search(line))


def classify(exit_code: int | None, metrics: dict | None, metric_key: str, log_text: str, timed_out: bool,
             result_file: str = METRICS_FILE, invalid: str = "") -> tuple[Status, str]:
    """Decide an experiment's outcome from facts, never from a word in the logs.

    Order: a positive finite ``metric_key`` in the result file is OK (whatever stderr says); a timeout is TIMEOUT;
    a raised exception that is an allocator's out-of-memory error is OOM, with that exception as the reason;
    anything else is FAILED: for exit code 0 with what is wrong with the result file, otherwise with the exit code
    and the last exception a rank raised (else the last error line). A log line that only mentions memory is never
    an OOM, since an OOM moves the memory model's prediction for every config and is reused on a rerun.


    Args:
        metrics: the result file's content; None when it is missing or invalid.
        metric_key: the key whose value says the run succeeded.
        log_text: the logs' tails.
        result_file: the result file's name, for messages.
        invalid: why the result file, though present, could not be read ('' if it could, or is missing).

    Returns:
        (status, a one-line reason; empty for OK).
    """

    if metrics is not None and _positive(metrics.get(metric_key)):
        return Status.OK, ""
    if timed_out:
        return Status.TIMEOUT, "killed after the timeout"
    raised = _raised_errors(log_text)
    oom = next((line for kind, line in raised if _is_oom(kind, line)), None)
    if oom is not None:
        return Status.OOM, oom[-300:]
    if exit_code == 0:
        if invalid:
            return Status.FAILED, f"{result_file} is invalid: {invalid}"
        if metrics is not None:
            return Status.FAILED, f"{result_file} has no positive '{metric_key}'"
        return Status.FAILED, f"exited 0 without writing {result_file} ({_MISSING_HINT.get(result_file, '')})"
    cause = raised[-1][1][-300:] if raised else _last_error_line(log_text)
    return Status.FAILED, f"exit code {exit_code}: {cause}"


def _positive(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:)", ln) and "launch.py" not in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


def _logs(exp_dir: Path) -> str:
    return _tail(exp_dir / STDERR_LOG) + "\n" + _tail(exp_dir / STDOUT_LOG)


def file_size(path: Path) -> int:
    """A file's size in bytes; 0 when it does not exist (yet) or cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, file_size(path) - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
