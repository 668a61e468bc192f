"""Which of a config's memory-relevant keys the memory model prices (`zerotune.model.memory`), so that a key it
does not know is named, never ignored silently.

Rules (`unmodelled_keys`): a key of ``zero_optimization`` (its ``offload_*`` sections included), ``fp16``, ``bf16`` or
an enabled ``compile`` section is *priced* (`PRICED_ZERO`, `PRICED_OFFLOAD`, `zerotune.model.zero_options`),
*memory-neutral* (logging, checkpoints, numerics, an offload's host side: `NEUTRAL_ZERO`, `NEUTRAL_OFFLOAD`,
`KNOWN_PRECISION`), or else *not in the memory model* and named, each DeepSpeed release's new keys included.
"""
from __future__ import annotations

from typing import Any

from zerotune.deepspeed.keys import CHECKPOINTING, ZERO

__all__ = ["unmodelled_keys"]

PRICED_ZERO = frozenset({
    "stage", "offload_optimizer", "offload_param", "contiguous_gradients", "overlap_comm", "reduce_bucket_size",
    "reduce_scatter", "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_max_live_parameters",
    "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance", "stage3_param_persistence_threshold",
    "param_persistence_threshold", "zero_hpz_partition_size", "sub_group_size"})
"""``zero_optimization`` keys `zerotune.model.memory` reads (by the key and by DeepSpeed's field name)."""
NEUTRAL_ZERO = frozenset({
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "use_multi_rank_bucket_allreduce", "ignore_unused_parameters",
    "legacy_stage1", "elastic_checkpoint", "load_from_fp32_weights", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save", "log_trace_cache_warnings",
    "enable_sanity_checks", "parameter_alignment", "override_module_apply", "pipeline_loading_checkpoint",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "allgather_sequential", "stage3_module_granularity_threshold", "module_granularity_threshold", "leaf_module",
    "stage3_model_persistence_threshold", "model_persistence_threshold"})
"""``zero_optimization`` keys that move no device memory (``deepspeed/runtime/zero/config.py``: logging, checkpoint
saving, communication order, which modules ZeRO-3 hooks; ZeRO 1/2 all-gather their shards in place, so
``allgather_bucket_size`` holds no buffer of its own, `zerotune.model.memory`)."""
PRICED_OFFLOAD = frozenset({"device", "ratio"})
NEUTRAL_OFFLOAD = frozenset({"pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline",
                             "pipeline_read", "pipeline_write", "fast_init"})
"""``offload_optimizer`` / ``offload_param`` keys: the device is priced; these size the host's or NVMe's side
(``deepspeed/runtime/zero/offload_config.py``)."""
KNOWN_PRECISION = frozenset({"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states",
                             "fp16_master_weights_and_grads", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                             "consecutive_hysteresis", "min_loss_scale", "auto_cast", "immediate_grad_update",
                             "check_grad_overflow"})
"""``fp16``/``bf16`` keys: ``enabled`` and the master weights' and states' dtypes are priced
(`zerotune.model.zero_options`), the rest is loss scaling (numbers, no tensors)."""


def unmodelled_keys(ds_config: dict[str, Any]) -> list[str]:
    """The dotted keys ``ds_config`` sets that may change device memory and `zerotune.model.memory` does not
    price, in the config's order (module docstring); a disabled ``compile`` section and zerotune's own
    ``gradient_checkpointing`` are not among them."""
    found: list[str] = []
    zero = ds_config.get(ZERO)
    if isinstance(zero, dict):
        for key, value in zero.items():
            if key in ("offload_optimizer", "offload_param") and isinstance(value, dict):
                found += [f"{ZERO}.{key}.{k}" for k in value if k not in PRICED_OFFLOAD | NEUTRAL_OFFLOAD]
            elif key not in PRICED_ZERO | NEUTRAL_ZERO:
                found.append(f"{ZERO}.{key}")
    for section in ("fp16", "bf16", "bfloat16"):
        if isinstance(ds_config.get(section), dict):
            found += [f"{section}.{k}" for k in ds_config[section] if k not in KNOWN_PRECISION]
    compile_ = ds_config.get("compile")
    if isinstance(compile_, dict) and (compile_.get("enabled") or compile_.get("deepcompile")):
        found += [f"compile.{k}" for k in compile_ if k != "enabled"] or ["compile.enabled"]
    return [k for k in found if k != CHECKPOINTING]
