"""The step probe, tuner side: where it lives, and reading the streams it writes.

The probe itself is `zerotune.probe.sitecustomize`, run in the ranks (this directory first on their ``PYTHONPATH``,
``PYTHON_ZEROTUNE_PROBE_DIR`` set: `zerotune.deepspeed.launcher.launch_env`); it writes one JSON line per optimizer
step to ``probe.rank<RANK>.jsonl`` in the experiment directory, which `read_streams` reads back, each line validated
once into a `zerotune.core.step_record.StepRecord`, for `zerotune.core.measure`, `zerotune.core.stopping` and the
backends. In the profile run it also writes the bytes saved for the backward pass (`read_saved_activations`) and
what activation checkpointing would hold instead (`read_checkpointed_activations`). Each rank that stepped writes
an exit record as Python finishes; `clean_exits` tells from them a crash in the teardown from a script that failed.
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

__all__ = ["ACTIVATIONS_RECORD", "BUDGET_ENV", "DATA_PEAK_KEY", "DEVICE_PEAK_KEY", "GROWTH_KEYS", "PAD_FILE",
           "PROBE_DIR_ENV", "PROBE_PATH", "SHAPE_KEYS", "SLOPE_KEY", "SLOPE_KEYS", "SQUARE_KEYS", "clean_exits",
           "clear_streams", "exit_name", "read_exits", "read_model_shapes", "read_checkpointed_activations",
           "read_saved_activations", "read_square_activations", "read_streams", "run_phases", "step_records",
           "stream_files", "stream_name"]

PROBE_PATH = Path(__file__).resolve().parent  # put first on the ranks' PYTHONPATH
SHAPE_KEYS = ("largest_layer_params", "persistent_params")  # elements, in ACTIVATIONS_RECORD
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
    """rank -> its exit record (`zerotune.probe.sitecustomize.exit_name`: ``steps``, ``uncaught``,
    ``exit_status``), written as the rank's Python finished. Ranks without a valid record are absent
    (the rank never stepped, or died before its interpreter's finalization)."""
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
    """Whether all ``world_size`` ranks (0 .. world_size - 1) recorded a clean end of their script: an
    exit record with no uncaught exception and no ``sys.exit`` with a status other than 0.

    A launch that exits non-zero after that crashed in the interpreter's teardown, after every step
    its ranks recorded (a rank aborting with ``terminate called without an active exception``): what
    was measured stands. A script that raised or called ``sys.exit(1)`` after its last step is not
    clean: the user would see it fail.
    """
    exits = read_exits(exp_dir)
    return world_size > 0 and sorted(exits) == list(range(world_size)) and all(
        r.get("uncaught") is None and r.get("exit_status") in (None, 0) for r in exits.values())


def read_streams(exp_dir: Path) -> dict[int, list[StepRecord]]:
    """Each rank's probe lines in ``exp_dir``, in file order: rank -> its step records.

    A line that is not a JSON object (a rank killed while writing) is skipped. Ranks without a
    file are absent; an empty dict when the probe wrote nothing (the simulated backend's failed runs,
    the profile run, a run that failed before its first optimizer step).
    """
    streams = {}
    for rank, path in sorted(stream_files(exp_dir).items()):
        records = (StepRecord.parse(text) for text in path.read_text(errors="replace").splitlines())
        streams[rank] = [record for record in records if record is not None]
    return streams


def step_records(streams: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[int, list[StepRecord]]:
    """rank -> its records: each decoded JSON object validated once (`StepRecord.from_dict`), as
    `read_streams` gives the same lines written to files. For streams held in memory (a simulated run's)."""
    return {rank: [StepRecord.from_dict(r) for r in records] for rank, records in streams.items()}


def run_phases(streams: Mapping[int, Sequence[StepRecord]], launched_at: float | None) -> tuple[float | None,
                                                                                                 float | None]:
    """A run's start-up and measuring seconds from its streams: ``(startup_s, measure_s)``, where ``startup_s`` is
    from ``launched_at`` (``time.monotonic()`` at the launch; the probe's ``t`` is the same clock, the ranks run on
    this machine) to the start of the first step of any rank (its ``t - step_s``: the engine's first forward), and
    ``measure_s`` from there to the end of the last step recorded. Either is None where the streams cannot say
    (no step; ``startup_s`` also without ``launched_at``)."""
    starts = [r.t - r.step_s for records in streams.values() for r in records[:1]
              if r.t is not None and r.step_s is not None]
    ends = [r.t for records in streams.values() for r in records if r.t is not None]
    if not starts:
        return None, None
    first = min(starts)
    startup = None if launched_at is None else max(0.0, first - launched_at)
    return startup, (max(0.0, max(ends) - first) if ends else None)


def clear_streams(exp_dir: Path) -> None:
    """Remove the streams and exit records of an earlier attempt in ``exp_dir`` (the probe appends);
    called by a backend before it launches."""
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
    """Bytes per sample that a training step holds for the backward pass at its peak, from the profile
    run's first forward (the probe's `ACTIVATIONS_RECORD`): ``saved_bytes``, what that forward saved,
    plus ``recompute_bytes``, the most one activation-checkpointed region saves while the backward pass
    recomputes it (absent: no checkpointing), over ``micro_batch_size``. None when the probe wrote no valid
    record (not a profile run, an older probe, a run that died before its forward)."""
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
    """Bytes per sample that a training step would hold for the backward pass with activation checkpointing of
    every checkpointable layer, priced in a profile run without it (the probe's `ACTIVATIONS_RECORD`:
    ``checkpointed_bytes`` over ``micro_batch_size``;
    `zerotune.probe._zerotune_probe.activations._LayerCheckpointing`).
    None when the record has no valid figure (no checkpointable layer, layers checkpointed already, an older
    probe, not a profile run)."""
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
    """What the profile run's first forward saved of tensors that grow with the square of the sequence length
    (the probe's `ACTIVATIONS_RECORD`, `SQUARE_KEYS`): ``square_seq_len``, the length of the batch
    counted, tokens; ``square_saved_bytes``, its saved ``[..., L, L]`` tensors (attention scores), bytes;
    ``micro_batch_size``. None without a valid record (no token ids in the batch, an older probe, not a profile
    run)."""
    record = _activations_record(exp_dir)
    if not isinstance(record, dict) or not all(isinstance(record.get(k), int) and not isinstance(record[k], bool)
                                               and record[k] >= 0 for k in SQUARE_KEYS):
        return None
    if record["square_seq_len"] < 2 or record["micro_batch_size"] < 1:
        return None
    return {k: record[k] for k in SQUARE_KEYS}


def read_model_shapes(exp_dir: Path) -> dict[str, int]:
    """The profile run's `SHAPE_KEYS` from the probe's `ACTIVATIONS_RECORD`: the most
    parameters one module holds and the parameters ZeRO-3 keeps gathered, elements; and on CUDA
    `DEVICE_PEAK_KEY` (on CPU `DATA_PEAK_KEY`), bytes; `GROWTH_KEYS`, what the
    allocated memory grew by at its peak over the first forward and over the whole step (forward and
    backward) at the record's ``micro_batch_size``, bytes; on CPU `SLOPE_KEYS`, what a training micro
    step's allocated peak and ``VmData``'s peak grow by per sample, bytes. A key whose value is missing or not a
    non-negative integer is left out (an empty dict without a valid record)."""
    record = _activations_record(exp_dir)
    if not isinstance(record, dict):
        return {}
    return {k: record[k] for k in (*SHAPE_KEYS, DEVICE_PEAK_KEY, DATA_PEAK_KEY, *GROWTH_KEYS, *SLOPE_KEYS)
            if isinstance(record.get(k), int) and not isinstance(record[k], bool) and record[k] >= 0}
