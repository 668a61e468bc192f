"""The step probe, tuner side: where it lives, and reading the streams it writes.

The probe (`zerotune.probe.sitecustomize`, first on the ranks' ``PYTHONPATH``: `zerotune.deepspeed.launcher.launch_env`)
writes one JSON line per optimizer step to ``probe.rank<RANK>.jsonl`` in the experiment directory, which
`read_streams` reads back as `zerotune.core.step_record.StepRecord`. The profile run's `ACTIVATIONS_RECORD` holds
what its first forward saved for the backward pass (the ``read_*`` functions: None, or ``{}``, without a valid
figure). Each rank that stepped writes an exit record as Python finishes (`read_exits`, `clean_exits`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from zerotune.core import user_files
from zerotune.core.errors import ConfigError
from zerotune.core.step_record import StepRecord
from zerotune.probe.sitecustomize import (
    ACTIVATIONS_RECORD,
    BUDGET_ENV,
    EXIT_PREFIX,
    EXIT_SUFFIX,
    PAD_FILE,
    PROBE_DIR_ENV,
    STREAM_PREFIX,
    STREAM_SUFFIX,
    exit_name,
    stream_name,
)

__all__ = ["ACTIVATIONS_RECORD", "BUDGET_ENV", "DATA_PEAK_KEY", "DEVICE_NAME_KEY", "DEVICE_PEAK_KEY", "FLOPS_KEYS",
           "GROWTH_KEYS", "PAD_FILE", "PROBE_DIR_ENV", "PROBE_PATH", "SHAPE_KEYS", "SLOPE_KEY", "SLOPE_KEYS",
           "SQUARE_KEYS", "clean_exits", "clear_streams", "exit_name", "read_exits", "read_model_shapes",
           "read_checkpointed_activations", "read_saved_activations", "read_square_activations", "read_streams",
           "run_phases", "step_records", "stream_files", "stream_name"]

PROBE_PATH = Path(__file__).resolve().parent  # put first on the ranks' PYTHONPATH
SHAPE_KEYS = ("largest_layer_params", "persistent_params")  # elements, in ACTIVATIONS_RECORD
FLOPS_KEYS = ("num_layers", "hidden_size", "experts_per_token", "routed_params", "num_experts")  # zerotune.model.flops
DEVICE_NAME_KEY = "device_name"  # in ACTIVATIONS_RECORD on CUDA: the device's name, for its peak FLOP/s
DEVICE_PEAK_KEY = "device_peak_bytes"  # in ACTIVATIONS_RECORD on CUDA
DATA_PEAK_KEY = "data_peak_bytes"  # in ACTIVATIONS_RECORD on CPU: rank 0's largest VmData, sampled every 5 ms
GROWTH_KEYS = ("step_growth_bytes", "forward_growth_bytes")  # in ACTIVATIONS_RECORD, bytes at its mbs
SLOPE_KEY = "slope_bytes"  # in ACTIVATIONS_RECORD on CPU: the step's growth per sample (two widened micro steps)
SLOPE_KEYS = (SLOPE_KEY, "data_slope_bytes")  # ... and VmData's peak per sample over the same steps


def stream_files(exp_dir: Path) -> dict[int, Path]:
    """rank -> the path of its probe stream in ``exp_dir`` (ranks without a file are absent)."""
    return _rank_files(exp_dir, STREAM_PREFIX, STREAM_SUFFIX)


def _rank_files(exp_dir: Path, prefix: str, suffix: str) -> dict[int, Path]:
    files = {}
    for path in Path(exp_dir).glob(f"{prefix}*{suffix}"):
        rank = path.name[len(prefix):-len(suffix)]
        if rank.isdigit():
            files[int(rank)] = path
    return files


def read_exits(exp_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its exit record (`exit_name`: ``steps``, ``uncaught``, ``exit_status``); a rank without a valid one (it
    never stepped, or died before its interpreter's finalization) is absent."""
    exits = {}
    for rank, path in sorted(_rank_files(exp_dir, EXIT_PREFIX, EXIT_SUFFIX).items()):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            exits[rank] = record
    return exits


def clean_exits(exp_dir: Path, world_size: int) -> bool:
    """Whether all ``world_size`` ranks (0 .. world_size - 1) recorded a clean end of their script: an exit record
    with no uncaught exception and no ``sys.exit`` status other than 0. A launch that exits non-zero after that crashed
    in the interpreter's teardown, after every step recorded: what was measured stands."""
    exits = read_exits(exp_dir)
    return world_size > 0 and sorted(exits) == list(range(world_size)) and all(
        r.get("uncaught") is None and r.get("exit_status") in (None, 0) for r in exits.values())


def read_streams(exp_dir: Path) -> dict[int, list[StepRecord]]:
    """rank -> its step records, in file order; a line that is not a JSON object (a rank killed while writing) is
    skipped, a rank without a file absent (an empty dict when the probe wrote nothing)."""
    streams = {}
    for rank, path in sorted(stream_files(exp_dir).items()):
        records = (StepRecord.parse(text) for text in path.read_text(errors="replace").splitlines())
        streams[rank] = [record for record in records if record is not None]
    return streams


def step_records(streams: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[int, list[StepRecord]]:
    """rank -> its records, each decoded object validated as `read_streams` does; for in-memory (simulated) streams."""
    return {rank: [StepRecord.from_dict(r) for r in records] for rank, records in streams.items()}


def run_phases(streams: Mapping[int, Sequence[StepRecord]], launched_at: float | None) -> tuple[float | None,
                                                                                                 float | None]:
    """``(startup_s, measure_s)`` of a run: ``startup_s`` from ``launched_at`` (``time.monotonic()`` at the launch, the
    probe's ``t`` clock) to the start of any rank's first step (``t - step_s``), ``measure_s`` from there to the last
    step's end. Either is None where the streams cannot say (no step; ``startup_s`` also without ``launched_at``)."""
    starts = [r.t - r.step_s for records in streams.values() for r in records[:1]
              if r.t is not None and r.step_s is not None]
    ends = [r.t for records in streams.values() for r in records if r.t is not None]
    if not starts:
        return None, None
    first = min(starts)
    startup = None if launched_at is None else max(0.0, first - launched_at)
    return startup, (max(0.0, max(ends) - first) if ends else None)


def clear_streams(exp_dir: Path) -> None:
    """Remove an earlier attempt's streams and exit records in ``exp_dir`` (the probe appends); before a launch."""
    for path in [*stream_files(exp_dir).values(), *_rank_files(exp_dir, EXIT_PREFIX, EXIT_SUFFIX).values()]:
        path.unlink(missing_ok=True)


def _activations_record(exp_dir: Path) -> Any:
    """The JSON of the probe's `ACTIVATIONS_RECORD` in ``exp_dir``, read bounded as a file the user names (the
    directory may be one: ``zerotune estimate --profile DIR``); None when it is missing or not such a file."""
    try:
        return user_files.load_json(Path(exp_dir) / ACTIVATIONS_RECORD, ACTIVATIONS_RECORD, "a probe record")
    except ConfigError:
        return None


def read_saved_activations(exp_dir: Path) -> int | None:
    """Bytes per sample a training step holds for the backward pass at its peak: (``saved_bytes`` + ``recompute_bytes``,
    the most one checkpointed region saves while the backward recomputes it) / ``micro_batch_size``."""
    record = _activations_record(exp_dir)
    try:
        saved, mbs = record["saved_bytes"], record.get("micro_batch_size", 1)
        recompute = record.get("recompute_bytes", 0)
    except (TypeError, KeyError, AttributeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (saved, recompute)):
        return None
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        return None
    return (saved + recompute) // mbs


def read_checkpointed_activations(exp_dir: Path) -> int | None:
    """Bytes per sample a training step would hold for the backward pass with every checkpointable layer checkpointed,
    priced in a profile run without it: ``checkpointed_bytes`` / ``micro_batch_size``
    (`zerotune.probe._zerotune_probe.activations._LayerCheckpointing`)."""
    record = _activations_record(exp_dir)
    try:
        checkpointed, mbs = record["checkpointed_bytes"], record.get("micro_batch_size", 1)
    except (TypeError, KeyError, AttributeError):
        return None
    if isinstance(checkpointed, bool) or not isinstance(checkpointed, int) or checkpointed < 0:
        return None
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        return None
    return checkpointed // mbs


SQUARE_KEYS = ("square_seq_len", "square_saved_bytes", "micro_batch_size")


def read_square_activations(exp_dir: Path) -> dict[str, int] | None:
    """`SQUARE_KEYS`, the first forward's tensors that grow with the square of the sequence length: ``square_seq_len``,
    tokens; ``square_saved_bytes``, its saved ``[..., L, L]`` tensors (attention scores); ``micro_batch_size``."""
    record = _activations_record(exp_dir)
    if not isinstance(record, dict) or not all(isinstance(record.get(k), int) and not isinstance(record[k], bool)
                                               and record[k] >= 0 for k in SQUARE_KEYS):
        return None
    if record["square_seq_len"] < 2 or record["micro_batch_size"] < 1:
        return None
    return {k: record[k] for k in SQUARE_KEYS}


def read_model_shapes(exp_dir: Path) -> dict[str, int]:
    """The record's `SHAPE_KEYS` (elements), `DEVICE_PEAK_KEY` or `DATA_PEAK_KEY`, `GROWTH_KEYS` and `SLOPE_KEYS`
    (bytes; `zerotune.probe._zerotune_probe.growth`), `FLOPS_KEYS`; a key missing or not a non-negative integer is
    left out; `DEVICE_NAME_KEY`, a text of at most 200 characters."""
    record = _activations_record(exp_dir)
    if not isinstance(record, dict):
        return {}
    name = record.get(DEVICE_NAME_KEY)
    return {**{k: record[k] for k in (*SHAPE_KEYS, DEVICE_PEAK_KEY, DATA_PEAK_KEY, *GROWTH_KEYS, *SLOPE_KEYS,
                                      *FLOPS_KEYS)
               if isinstance(record.get(k), int) and not isinstance(record[k], bool) and record[k] >= 0},
            **({DEVICE_NAME_KEY: name} if isinstance(name, str) and 0 < len(name) <= 200 else {})}
