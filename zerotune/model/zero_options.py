"""The DeepSpeed options beyond stage, offload and buckets that change ZeRO's bytes per device, as the memory model
(`zerotune.model.memory`) prices them. Sources: DeepSpeed 0.19.8, paths under ``deepspeed/runtime/`` (`ZeroOptions`).

Rules (read by `ZeroOptions.of`): low-precision master weights (stages 1-3) make the master copy and the gradient
partition 2 bytes an element, and ``bf16.bf16_optimizer_states`` halves the optimizer states; a partial optimizer
offload (``offload_optimizer.ratio``, stage 3) keeps whole sub-groups on the device (`ZeroOptions.device_fraction`);
hpZ (stage 3) adds a secondary partition, ``b*Psi/h``; AutoTP (ZeRO 0-2) is priced as model parallelism of size tp,
``Psi/tp`` parameters over a DP world size of ``N/tp``; Ulysses sp divides a sample's activations by sp, and ZeRO
partitions over all N ranks. ZeRO++ qwZ and qgZ buffers are not priced (`zerotune.model.coverage` names them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zerotune.deepspeed.keys import ZERO, ZERO_DEFAULTS

__all__ = ["ZeroOptions", "approximations", "samples_per_step"]

DEFAULT_SUB_GROUP_SIZE: int = ZERO_DEFAULTS[3]["sub_group_size"]  # zero/config.py:182


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def _section(ds_config: dict[str, Any], key: str) -> dict[str, Any]:
    value = ds_config.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ZeroOptions:
    """The options of one ds_config that the memory model prices here (module docstring).

    Attributes:
        master_bytes: bytes per element of the master copy and the step's gradient partition: 2 with
            ``bf16.bf16_master_weights_and_grads`` or ``fp16.fp16_master_weights_and_grads`` (stages 1-3,
            ``base_optimizer.py:485-530``), else 4.
        states_scale: optimizer state bytes over fp32 states: 0.5 with ``bf16_optimizer_states`` too (created like
            the master copy), else 1 (DeepSpeed then requires them offloaded, ``base_optimizer.py:509-519``).
        offload_ratio: ``offload_optimizer.ratio`` r (1: all, the default): stage 3's sub-groups from
            ``int((1 - r) * G)`` on go to the host (``zero/stage3.py:1100-1108``).
        sub_group_size: ``zero_optimization.sub_group_size``, elements.
        hpz: ``zero_hpz_partition_size`` h (1: none): a secondary partition of every parameter over its node group's
            h ranks, in its dtype, on ``offload_param``'s device (``zero/partition_parameters.py``).
        tp: ``tensor_parallel.autotp_size`` (1: none); what AutoTP keeps whole (embeddings, norms) is under-counted,
            the activations taken as measured or given (``engine.py:595-600``).
        sp: ``sequence_parallel_size`` (1: none); activation figures scale by their measured degree over sp
            (`zerotune.model.memory.MemoryModel.activation_sp`; ``engine.py:2164-2165``).
    """

    master_bytes: int = 4
    states_scale: float = 1.0
    offload_ratio: float = 1.0
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    hpz: int = 1
    tp: int = 1
    sp: int = 1

    @classmethod
    def of(cls, ds_config: dict[str, Any]) -> "ZeroOptions":
        """The options ``ds_config`` sets; a value that is not a number (``"auto"``, a list of candidates) takes
        DeepSpeed's default."""
        zero = _section(ds_config, ZERO)
        bf16, fp16 = _section(ds_config, "bf16") or _section(ds_config, "bfloat16"), _section(ds_config, "fp16")
        stage = zero.get("stage") if isinstance(zero.get("stage"), int) else 0
        low = stage >= 1 and (bf16.get("bf16_master_weights_and_grads") is True
                              or fp16.get("fp16_master_weights_and_grads") is True)
        ratio = _section(zero, "offload_optimizer").get("ratio", 1.0)
        ratio = float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) \
            and 0 <= ratio <= 1 else 1.0
        return cls(master_bytes=2 if low else 4,
                   states_scale=0.5 if low and bf16.get("bf16_optimizer_states") is True else 1.0,
                   offload_ratio=ratio if stage == 3 else 1.0,
                   sub_group_size=_int(zero.get("sub_group_size"), DEFAULT_SUB_GROUP_SIZE),
                   hpz=_int(zero.get("zero_hpz_partition_size"), 1) if stage == 3 else 1,
                   tp=_int(_section(ds_config, "tensor_parallel").get("autotp_size"), 1),
                   sp=_int(ds_config.get("sequence_parallel_size"), 1))

    def sub_groups(self, trainable_per_rank: float, largest_per_rank: float = 0) -> int:
        """ZeRO-3's optimizer sub-groups on a rank, ``G = ceil((T/N) / (S + L/N))``, for ``T/N`` trainable and
        ``L/N`` largest-layer elements: a sub-group closes at the parameter that takes it to ``sub_group_size`` S
        (``zero/stage3.py:1210-1233``). With the default S of 1e9 a rank below a billion trainable parameters has
        one sub-group, and any offload ratio above 0 offloads all of it."""
        return max(1, math.ceil(trainable_per_rank / (self.sub_group_size + largest_per_rank)))

    def device_fraction(self, trainable_per_rank: float, largest_per_rank: float = 0) -> float:
        """The fraction of the master copy, the optimizer states and the fp32 gradients that an optimizer offload
        leaves on the device: ``int((1 - r) * G) / G`` sub-groups (`sub_groups`); 0 for a full offload."""
        if self.offload_ratio >= 1:
            return 0.0
        groups = self.sub_groups(trainable_per_rank, largest_per_rank)
        return int((1 - self.offload_ratio) * groups) / groups


def samples_per_step(ds_config: dict[str, Any], devices: int | None = None) -> int | None:
    """The distinct samples one optimizer step of ``ds_config`` trains: its ``train_batch_size`` (without one, mbs x
    gas x ``devices`` / its Ulysses degree, as DeepSpeed counts it, D331) over its AutoTP degree, whose ranks hold one
    batch though DeepSpeed counts each of them at ZeRO 0-2 (D334). None where neither gives a positive count."""
    options, batch = ZeroOptions.of(ds_config), ds_config.get("train_batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        mbs, gas = ds_config.get("train_micro_batch_size_per_gpu"), ds_config.get("gradient_accumulation_steps", 1)
        if not devices or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (mbs, gas)):
            return None
        batch = mbs * gas * devices // options.sp
    return max(1, batch // options.tp)


def approximations(ds_config: dict[str, Any]) -> list[str]:
    """What the memory model assumes for the options ``ds_config`` sets that it prices only in part, one line each
    (the summary's and ``estimate``'s notes)."""
    options, notes = ZeroOptions.of(ds_config), []
    if options.tp > 1:
        notes.append(f"tensor_parallel.autotp_size {options.tp}: every parameter counted as sharded over {options.tp} "
                     "ranks (the embeddings and norms AutoTP keeps whole are under-counted) and the activations "
                     "as measured or given")
    return notes
