"""One optimizer step of one rank as the step probe records it (one line of its stream), validated once.

`zerotune.probe.read_streams` parses the streams into these; the metric, the stop rule and the backends read them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One line of a probe stream (the fields `zerotune.probe._zerotune_probe.records` writes, same names and
    units), validated once (`from_dict`).

    A field is None where the line lacks it or holds anything but a finite non-bool number (``step``, ``rank``: an
    ``int``; ``batch_samples``, ``seq_len``, ``tokens``: an ``int`` >= 1). Counts and bytes are truncated to ``int``. A
    record without a valid ``step`` still carries its peaks.

    Attributes:
        step: the optimizer step's index in the rank's process, from 1.
        t: ``time.monotonic()`` when the step returned, seconds (one clock for every rank of a machine).
        step_s: wall time from the end of the previous optimizer step to the end of this one, seconds.
        boundary_s: the part of ``step_s`` spent in the work done once per optimizer step, seconds.
        micro_steps: ``step()`` calls in this optimizer step (gradient accumulation steps).
        train_batch_size: global samples per optimizer step.
        batch_samples: the most samples one of this step's micro batches held on this rank (leading dimension).
        seq_len: the longest sequence one of this step's micro batches held on this rank, tokens (the largest
            second dimension of the forward's integer tensors of 2+ dimensions); None without token ids.
        tokens: per forward of this step on this rank its samples times its ``seq_len``, summed, tokens (padding
            included); None where a forward lacked either.
        peak_bytes, peak_reserved_bytes, device_peak_bytes, rss_peak_bytes: high-water marks, bytes. On CUDA the
            allocated, the allocator's reserved and the device's (reserved plus outside the allocator); on CPU
            ``peak_bytes`` is the largest ``VmData`` so far and ``rss_peak_bytes`` ``ru_maxrss``.
        base_bytes: on CUDA the allocated bytes just before the step's first forward (from step 2 on: the model
            states), bytes.
        autotp_size: the engine's AutoTP degree t (None: 1). Its t ranks hold the same batch, and at ZeRO 0-2
            ``train_batch_size`` counts each of them (D331), so a step's samples are ``train_batch_size / t``.
    """

    rank: int | None = None
    step: int | None = None
    t: float | None = None
    step_s: float | None = None
    boundary_s: float | None = None
    micro_steps: int | None = None
    train_batch_size: int | None = None
    batch_samples: int | None = None
    seq_len: int | None = None
    tokens: int | None = None
    peak_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_peak_bytes: int | None = None
    rss_peak_bytes: int | None = None
    base_bytes: int | None = None
    autotp_size: int | None = None

    @property
    def peak(self) -> int | None:
        """The peak the per-device budget limits, bytes: ``device_peak_bytes`` where the record holds one
        (CUDA: allocated bytes leave out the allocator's cache and the context), else ``peak_bytes``."""
        return self.device_peak_bytes if self.device_peak_bytes is not None else self.peak_bytes

    @classmethod
    def parse(cls, line: str) -> StepRecord | None:
        """The record on one stream line; None when it is not a JSON object (a rank killed while writing it)."""
        try:
            data = json.loads(line)
        except ValueError:
            return None
        return cls.from_dict(data) if isinstance(data, dict) else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """The record from a decoded line (or a simulated run's), validated as the class docstring says."""
        def integer(key: str) -> int | None:
            value = data.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        def number(key: str) -> float | None:
            value = data.get(key)
            return float(value) if _finite(value) else None

        def count(key: str) -> int | None:
            value = data.get(key)
            return int(value) if _finite(value) else None

        def size(key: str) -> int | None:
            value = integer(key)
            return value if value is not None and value >= 1 else None

        return cls(rank=integer("rank"), step=integer("step"), t=number("t"), step_s=number("step_s"),
                   boundary_s=number("boundary_s"), micro_steps=count("micro_steps"),
                   train_batch_size=count("train_batch_size"), batch_samples=size("batch_samples"),
                   seq_len=size("seq_len"), tokens=size("tokens"), peak_bytes=count("peak_bytes"),
                   peak_reserved_bytes=count("peak_reserved_bytes"), device_peak_bytes=count("device_peak_bytes"),
                   rss_peak_bytes=count("rss_peak_bytes"), base_bytes=count("base_bytes"),
                   autotp_size=size("autotp_size"))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
