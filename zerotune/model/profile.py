"""The profile run: one real launch at the smallest mbs that reads what DeepSpeed measures.

DeepSpeed's engine writes ``model_info.json`` (``num_params``, ``trainable_num_params``,
``activation_mem_per_gpu``) and exits in the first forward pass when the config's
``autotuning.model_info.profile`` is set (``engine._get_model_parameters`` and ``forward``).
The run uses ZeRO stage 3 with small buckets, as DeepSpeed's own autotuner profiles with its
minimum-memory config, so that the model fits wherever any stage could.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_BUCKET_SIZE = 10_000_000
"""Elements per reduce/prefetch bucket in the profile run (40 MB in fp32): small, so it fits."""


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run measured.

    Attributes:
        num_params: parameters of the model over all model-parallel ranks.
        trainable_num_params: those with ``requires_grad``.
        activation_mem_per_gpu: activation bytes per device at mbs=1 (DeepSpeed's measure; on
            CPU it is the change in resident memory across the first forward pass).
        peak_memory_bytes: peak bytes per rank the backend saw during the run, when it can
            see it (CPU), else None.
    """

    num_params: int
    trainable_num_params: int
    activation_mem_per_gpu: int
    peak_memory_bytes: int | None = None


def profile_config(base: dict[str, Any], mbs: int, gas: int, dp_world_size: int) -> dict[str, Any]:
    """The ds_config of the profile run: ``base`` at ZeRO stage 3, ``mbs``, small buckets."""
    cfg = copy.deepcopy(base)
    cfg.pop("autotuning", None)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    zero["reduce_bucket_size"] = PROFILE_BUCKET_SIZE
    zero["stage3_prefetch_bucket_size"] = PROFILE_BUCKET_SIZE
    zero["stage3_max_live_parameters"] = PROFILE_BUCKET_SIZE
    cfg["train_micro_batch_size_per_gpu"] = mbs
    cfg["gradient_accumulation_steps"] = gas
    cfg["train_batch_size"] = mbs * gas * dp_world_size
    cfg["autotuning"] = {"enabled": True, "model_info": {"profile": True}}
    return cfg


def read_model_info(path: Path, peak_memory_bytes: int | None = None) -> ModelInfo:
    """Read DeepSpeed's ``model_info.json``.

    Raises:
        FileNotFoundError, KeyError, ValueError: the file is missing or lacks a field.
    """
    data = json.loads(Path(path).read_text())
    return ModelInfo(num_params=int(data["num_params"]),
                     trainable_num_params=int(data.get("trainable_num_params", data["num_params"])),
                     activation_mem_per_gpu=max(0, int(data.get("activation_mem_per_gpu", 0))),
                     peak_memory_bytes=peak_memory_bytes)
