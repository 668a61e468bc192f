"""The DeepSpeed options beyond stage, offload and buckets that change ZeRO's bytes per device, as the memory model
(`zerotune.model.memory`) prices them. Sources: DeepSpeed 0.19.8, paths under ``deepspeed/runtime/``.

- **Low-precision master weights** (``bf16.bf16_master_weights_and_grads``, ``fp16.fp16_master_weights_and_grads``;
  stages 1-3, ``config.py:706-714``): the master copy and the gradient partition of the optimizer step take the 16-bit
  dtype instead of fp32 (``base_optimizer.py:485-530`` ``_configure_master_weights``; ``zero/stage_1_and_2.py:561``,
  ``zero/stage3.py:1097-1171``): 2 bytes an element, not 4.
- **16-bit optimizer states** (``bf16.bf16_optimizer_states``, with the above): torch's optimizers create their states
  like the parameter they step, the master copy, so Adam keeps ``K/2`` bytes. Without it the states stay fp32 and
  DeepSpeed requires them offloaded (``base_optimizer.py:509-519``: DeepSpeedCPUAdam, fp32 states on the host).
- **Partial optimizer offload** (``offload_optimizer.ratio`` r, stage 3): the rank's optimizer sub-groups (at most
  ``sub_group_size`` elements each, ``zero/stage3.py:1210-1233``) from ``int((1 - r) * G)`` on go to the host, the
  first ones stay on the device (``zero/stage3.py:1100-1108``): the device keeps ``int((1 - r) * G) / G`` of the
  master, the states and the fp32 gradients. A sub-group closes at the parameter that takes it to ``sub_group_size``
  S elements, so it holds from S to S plus one parameter's partition, at most ``L/N``: ``G = ceil((T/N) / (S + L/N))``
  (L: the largest layer's parameters). With DeepSpeed's S of 1e9 a rank below a billion trainable parameters has one
  sub-group, and any ratio above 0 offloads all of it.
- **hpZ** (``zero_hpz_partition_size`` h > 1, stage 3): every parameter keeps a secondary partition over the h ranks
  of its node group, ``b*Psi/h`` more (``zero/partition_parameters.py:1900-1927``, in the parameter's dtype, on
  ``offload_param``'s device).
- **AutoTP** (``tensor_parallel.autotp_size`` tp > 1, ZeRO 0-2): the linear layers are sharded over tp ranks
  (``engine.py:595-600``) and ZeRO partitions over the data-parallel group of ``N / tp`` ranks. Priced as model
  parallelism of size tp: ``Psi/tp`` parameters, DP world size ``N/tp``; the tensors AutoTP keeps whole (embeddings,
  norms) are under-counted, and the activations are the figure measured or given (a note says both).
- **Ulysses sequence parallelism** (``sequence_parallel_size`` sp > 1): each rank holds ``1/sp`` of a sample's tokens,
  so its activations are ``1/sp`` of a sample's; ZeRO partitions over the sequence-data-parallel group, all N ranks
  (``engine.py:2164-2165``, ``:2252``). The activation figures carry the degree they were measured at
  (`zerotune.model.memory.MemoryModel.activation_sp`) and scale by ``that / sp``.

``zero_quantized_weights`` and ``zero_quantized_gradients`` (ZeRO++ qwZ, qgZ) need DeepSpeed's CUDA quantizer; their
buffers are not priced (`zerotune.model.coverage` names them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zerotune.deepspeed.keys import ZERO, ZERO_DEFAULTS

__all__ = ["ZeroOptions", "approximations"]

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
        master_bytes: bytes per element of the master copy and the optimizer step's gradient partition (4 or 2).
        states_scale: the optimizer states' bytes as a fraction of fp32 states (1 or 0.5).
        offload_ratio: ``offload_optimizer.ratio`` (1: all of it, DeepSpeed's default).
        sub_group_size: ``zero_optimization.sub_group_size``, elements.
        hpz: ``zero_hpz_partition_size`` (1: none).
        tp: ``tensor_parallel.autotp_size`` (1: none).
        sp: ``sequence_parallel_size`` (1: none).
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
        """ZeRO-3's optimizer sub-groups on a rank, ``G`` (module docstring), for ``T/N`` and ``L/N`` elements."""
        return max(1, math.ceil(trainable_per_rank / (self.sub_group_size + largest_per_rank)))

    def device_fraction(self, trainable_per_rank: float, largest_per_rank: float = 0) -> float:
        """The fraction of the master copy, the optimizer states and the fp32 gradients that an optimizer offload
        leaves on the device: ``int((1 - r) * G) / G`` sub-groups (module docstring); 0 for a full offload."""
        if self.offload_ratio >= 1:
            return 0.0
        groups = self.sub_groups(trainable_per_rank, largest_per_rank)
        return int((1 - self.offload_ratio) * groups) / groups


def approximations(ds_config: dict[str, Any]) -> list[str]:
    """What the memory model assumes for the options ``ds_config`` sets that it prices only in part, one line each
    (the summary's and ``estimate``'s notes)."""
    options, notes = ZeroOptions.of(ds_config), []
    if options.tp > 1:
        notes.append(f"tensor_parallel.autotp_size {options.tp}: every parameter counted as sharded over {options.tp} "
                     "ranks (the embeddings and norms AutoTP keeps whole are under-counted) and the activations "
                     "as measured or given")
    return notes
