"""The step probe, tuner side: where it lives, and reading the streams it writes.

The probe itself is :mod:`zerotune.probe.sitecustomize`, which runs in the ranks (this directory
first on their ``PYTHONPATH``, ``PYTHON_ZEROTUNE_PROBE_DIR`` set: :func:`zerotune.deepspeed.launcher.launch_env`);
it writes one JSON line per optimizer step to ``probe.rank<RANK>.jsonl`` in the experiment
directory. :func:`read_streams` reads them back for :func:`zerotune.core.measure.measure`; in the
profile run it also writes the bytes saved for the backward pass, which :func:`read_saved_activations`
reads back.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerotune.probe.sitecustomize import ACTIVATIONS_RECORD, PROBE_DIR_ENV, STREAM_PREFIX, STREAM_SUFFIX, stream_name

__all__ = ["ACTIVATIONS_RECORD", "DATA_PEAK_KEY", "DEVICE_PEAK_KEY", "PROBE_DIR_ENV", "PROBE_PATH", "SHAPE_KEYS", "clear_streams",
           "read_model_shapes",
           "read_saved_activations", "read_streams",
           "stream_files", "stream_name"]

PROBE_PATH = Path(__file__).resolve().parent  # put first on the ranks' PYTHONPATH
SHAPE_KEYS = ("largest_layer_params", "persistent_params")  # elements, in ACTIVATIONS_RECORD
DEVICE_PEAK_KEY = "device_peak_bytes"  # in ACTIVATIONS_RECORD on CUDA
DATA_PEAK_KEY = "data_peak_bytes"  # in ACTIVATIONS_RECORD on CPU: rank 0's largest VmData, sampled every 5 ms


def stream_files(exp_dir: Path) -> dict[int, Path]:
    """rank -> the path of its probe stream in ``exp_dir`` (ranks without a file are absent)."""
    files = {}
    for path in Path(exp_dir).glob(f"{STREAM_PREFIX}*{STREAM_SUFFIX}"):
        rank = path.name[len(STREAM_PREFIX):-len(STREAM_SUFFIX)]
        if rank.isdigit():
            files[int(rank)] = path
    return files


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
    """Remove the streams of an earlier attempt in ``exp_dir`` (the probe appends); called by a
    backend before it launches."""
    for path in stream_files(exp_dir).values():
        path.unlink(missing_ok=True)


def read_saved_activations(exp_dir: Path) -> int | None:
    """Bytes per sample that the profile run's first forward saved for the backward pass (the probe's
    :data:`ACTIVATIONS_RECORD`: ``saved_bytes`` over ``micro_batch_size``), or None when the probe
    wrote no valid record (not a profile run, an older probe, a run that died before its forward)."""
    try:
        record = json.loads((Path(exp_dir) / ACTIVATIONS_RECORD).read_text())
        saved, mbs = record["saved_bytes"], record.get("micro_batch_size", 1)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
        return None
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        return None
    return saved // mbs


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
