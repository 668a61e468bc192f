"""The step probe, tuner side: where it lives, and reading the streams it writes.

The probe itself is :mod:`zerotune.probe.sitecustomize`, which runs in the ranks (this directory
first on their ``PYTHONPATH``, ``PYTHON_ZEROTUNE_PROBE_DIR`` set: :func:`zerotune.deepspeed.launcher.launch_env`);
it writes one JSON line per optimizer step to ``probe.rank<RANK>.jsonl`` in the experiment
directory. :func:`read_streams` reads them back for :func:`zerotune.core.measure.measure`; in the
profile run it also writes the bytes saved for the backward pass, which :func:`read_saved_activations`
reads back. Each rank that stepped writes an exit record as Python finishes; :func:`clean_exits` tells
from them a crash in the interpreter's teardown from a script that failed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerotune.probe.sitecustomize import (ACTIVATIONS_RECORD, EXIT_PREFIX, EXIT_SUFFIX, PROBE_DIR_ENV, STREAM_PREFIX,
                                          STREAM_SUFFIX, exit_name, stream_name)

__all__ = ["ACTIVATIONS_RECORD", "DATA_PEAK_KEY", "DEVICE_PEAK_KEY", "PROBE_DIR_ENV", "PROBE_PATH", "SHAPE_KEYS",
           "clean_exits", "clear_streams", "exit_name", "read_exits", "read_model_shapes",
           "read_saved_activations", "read_streams",
           "stream_files", "stream_name"]

PROBE_PATH = Path(__file__).resolve().parent  # put first on the ranks' PYTHONPATH
SHAPE_KEYS = ("largest_layer_params", "persistent_params")  # elements, in ACTIVATIONS_RECORD
DEVICE_PEAK_KEY = "device_peak_bytes"  # in ACTIVATIONS_RECORD on CUDA
DATA_PEAK_KEY = "data_peak_bytes"  # in ACTIVATIONS_RECORD on CPU: rank 0's largest VmData, sampled every 5 ms


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
    """rank -> its exit record (:func:`~zerotune.probe.sitecustomize.exit_name`: ``steps``, ``uncaught``,
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


def read_streams(exp_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's probe lines in ``exp_dir``, in file order: rank -> list of step records.

    A line that is not a JSON object (a rank killed while writing) is skipped. Ranks without a
    file are absent; an empty dict when the probe wrote nothing (a SIMULATED run, the profile
    run, a run that failed before its first optimizer step).
    """
    streams = {}
    for rank, path in sorted(stream_files(exp_dir).items()):
        lines = []
        for text in path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if isinstance(line, dict):
                lines.append(line)
        streams[rank] = lines
    return streams


def clear_streams(exp_dir: Path) -> None:
    """Remove the streams and exit records of an earlier attempt in ``exp_dir`` (the probe appends);
    called by a backend before it launches."""
    for path in [*stream_files(exp_dir).values(), *_rank_files(exp_dir, EXIT_PREFIX, EXIT_SUFFIX).values()]:
        path.unlink(missing_ok=True)


def read_saved_activations(exp_dir: Path) -> int | None:
    """Bytes per sample that a training step holds for the backward pass at its peak, from the profile
    run's first forward (the probe's :data:`ACTIVATIONS_RECORD`): ``saved_bytes``, what that forward saved,
    plus ``recompute_bytes``, the most one activation-checkpointed region saves while the backward pass
    recomputes it (absent: no checkpointing), over ``micro_batch_size``. None when the probe wrote no valid
    record (not a profile run, an older probe, a run that died before its forward)."""
    try:
        record = json.loads((Path(exp_dir) / ACTIVATIONS_RECORD).read_text())
        saved, mbs = record["saved_bytes"], record.get("micro_batch_size", 1)
        recompute = record.get("recompute_bytes", 0)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (saved, recompute)):
        return None
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        return None
    return (saved + recompute) // mbs


def read_model_shapes(exp_dir: Path) -> dict[str, int]:
    """The profile run's :data:`SHAPE_KEYS` from the probe's :data:`ACTIVATIONS_RECORD`: the most
    parameters one module holds and the parameters ZeRO-3 keeps gathered, elements; and on CUDA
    :data:`DEVICE_PEAK_KEY` (on CPU :data:`DATA_PEAK_KEY`), bytes. A key whose value is missing or not a non-negative integer is left
    out (an empty dict without a valid record)."""
    try:
        record = json.loads((Path(exp_dir) / ACTIVATIONS_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: record[k] for k in (*SHAPE_KEYS, DEVICE_PEAK_KEY, DATA_PEAK_KEY)
            if isinstance(record.get(k), int) and not isinstance(record[k], bool) and record[k] >= 0}
