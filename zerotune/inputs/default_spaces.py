"""zerotune's default tuning space for each ZeRO stage: the knobs the stage reads, with DeepSpeed's
candidates (`default_space`); the micro batch size is searched apart from it."""
from __future__ import annotations

from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import ZERO

__all__ = ["default_space"]

_BUCKETS = [5e7, 5e8, 1e9]  # elements; DeepSpeed's autotuning/constants.py


def default_space(stage: int, offload: bool = False, zeropp: bool = False) -> dict[str, Any]:
    """zerotune's default tuning space for a ZeRO stage, as a new dict: DeepSpeed's (autotuning/constants.py) narrowed
    to the knobs the stage reads.

    - stage 0: nothing to tune (the micro batch size only, searched apart).
    - stage 1: reduce_bucket_size × allgather_bucket_size (9).
    - stage 2: + overlap_comm, reduce_scatter, contiguous_gradients (72).
    - stage 3: overlap_comm, reduce_scatter, reduce_bucket_size and the ``stage3_`` prefetch bucket size, param
      persistence threshold, max live parameters and max reuse distance (288); not DeepSpeed's allgather knobs,
      which stage 3 does not read.

    ``offload`` adds ``offload_optimizer.device`` in [none, cpu] for stages 1-3 and ``offload_param.device`` for
    stage 3 (×2 / ×4); `zerotune.inputs.space.generate` refuses it without an optimizer DeepSpeed runs on the CPU.
    ``zeropp`` (several nodes, CUDA) adds ZeRO++'s quantized collectives to stage 3, ``zero_quantized_weights`` and
    ``zero_quantized_gradients`` in [false, true] (×4, D338).

    Raises:
        ConfigError: a stage other than 0-3.
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero["reduce_bucket_size"] = list(_BUCKETS)
        zero["allgather_bucket_size"] = list(_BUCKETS)
    if stage == 2:
        zero["overlap_comm"] = [True, False]
        zero["reduce_scatter"] = [True, False]
        zero["contiguous_gradients"] = [True, False]
    if stage == 3:
        zero["overlap_comm"] = [True, False]
        zero["reduce_scatter"] = [True, False]
        zero["reduce_bucket_size"] = list(_BUCKETS)
        zero["stage3_prefetch_bucket_size"] = list(_BUCKETS)
        zero["stage3_param_persistence_threshold"] = [1e5, 1e6]
        zero["stage3_max_live_parameters"] = [1e8, 1e9]
        zero["stage3_max_reuse_distance"] = [1e8, 1e9]
    if zeropp and stage == 3:
        zero["zero_quantized_weights"] = [False, True]
        zero["zero_quantized_gradients"] = [False, True]
    if offload and stage >= 1:
        zero["offload_optimizer"] = {"device": ["none", "cpu"]}
    if offload and stage == 3:
        zero["offload_param"] = {"device": ["none", "cpu"]}
    return {ZERO: zero}
