"""zerotune's default tuning space for each ZeRO stage: the knobs the stage reads, with DeepSpeed's
candidates (`default_space`); the micro batch size is searched apart from it."""
from __future__ import annotations

from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import ZERO

__all__ = ["default_space"]

_BUCKETS = [5e7, 5e8, 1e9]  # elements; DeepSpeed's autotuning/constants.py


def default_space(stage: int, offload: bool = False) -> dict[str, Any]:
    """zerotune's default tuning space for a ZeRO stage (the micro batch size is added by search).

    Started from DeepSpeed's (autotuning/constants.py), keeping only knobs the stage reads:

    - stage 0: nothing to tune (the micro batch size only).
    - stage 1: reduce_bucket_size × allgather_bucket_size (9).
    - stage 2: + overlap_comm, reduce_scatter, contiguous_gradients (72).
    - stage 3: overlap_comm, reduce_scatter, reduce_bucket_size, stage3_prefetch_bucket_size,
      stage3_param_persistence_threshold, stage3_max_live_parameters,
      stage3_max_reuse_distance (288). DeepSpeed also tunes allgather_partitions and
      allgather_bucket_size here, but stage 3 reads neither (they would only repeat experiments).

    Args:
        stage: ZeRO stage, 0..3.
        offload: add ``offload_optimizer.device`` in [none, cpu] where the stage allows it
            (1, 2, 3) and ``offload_param.device`` in [none, cpu] for stage 3 (×2 / ×4). Offload
            needs an optimizer DeepSpeed can run on the CPU
            (`zerotune.deepspeed.keys.OFFLOADABLE_OPTIMIZERS`);
            `zerotune.inputs.space.generate` refuses the space otherwise.

    Returns:
        A new dict (safe to modify).
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
    if offload and stage >= 1:
        zero["offload_optimizer"] = {"device": ["none", "cpu"]}
    if offload and stage == 3:
        zero["offload_param"] = {"device": ["none", "cpu"]}
    return {ZERO: zero}
