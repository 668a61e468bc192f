"""The memory model: bytes per device for a ds_config, as pure arithmetic.

Used to prune configurations that cannot fit (they are never launched) and to estimate the
largest micro batch size per GPU (mbs) each ZeRO stage can run.

Notation (all per device, bytes): Psi = parameters per model-parallel rank (``num_params / mp_size``,
``mp_size`` applied once: DeepSpeed's ``model_info.num_params`` is already the total over MP
ranks), N = data-parallel (DP) world size, b = bytes per element of the model's dtype (2 for
fp16/bf16, 4 for fp32).

==================  ==============================  ===================================  ======================
ZeRO stage          parameters                      gradients                            optimizer states (K)
==================  ==============================  ===================================  ======================
0                   b*Psi                           b*Psi                                K*Psi
1                   b*Psi                           b*Psi + 4*Psi/N                      K*Psi/N
2                   b*Psi                           b*Psi/N + 4*Psi/N                    K*Psi/N
3                   b*Psi/N + b*min(Psi, live)      b*Psi/N + 4*Psi/N                    K*Psi/N
==================  ==============================  ===================================  ======================

Sources: the ZeRO paper (Rajbhandari et al., 2020, sec. 5: P_os, P_os+g, P_os+g+p with K=12 for
mixed-precision Adam: fp32 master weights, momentum and variance) and DeepSpeed's code:

- ``stage_1_and_2.py`` keeps an fp32 copy of each partition (``single_partition_of_fp32_groups``)
  even in fp32 training, so K = 4 (master) + optimizer states for stages 1-3, and an fp32
  gradient partition (``4*Psi/N``) for the optimizer step. Stage 0 in fp32 steps the torch
  optimizer on the parameters themselves, so K = optimizer states only (8 for Adam).
- Adam/AdamW/Lamb keep 2 fp32 states per parameter (8 bytes), SGD/Adagrad 1 (4 bytes).
- ``live`` = ``stage3_max_live_parameters`` (DeepSpeed default 1e9): the gathered full
  parameters stage 3 keeps on device at once.
- Communication buffers follow the bucket knobs: with ``contiguous_gradients`` (default on),
  stages 1/2 allocate ``reduce_bucket_size`` elements of the reduction dtype, twice with
  ``overlap_comm`` (``setup_buckets``, "double buffers"); stage 3 allocates one
  ``reduce_bucket_size`` buffer (``stage3.py``). Stage 0 flattens gradients for all-reduce in
  chunks of at most 5e8 elements (``engine.buffered_allreduce_fallback``). With DeepSpeed's
  defaults that is one 2,000,000,000-byte buffer for fp32 stage 1 or 3.
- ``offload_optimizer`` to cpu/nvme moves optimizer states and the fp32 gradient partition off
  the device; ``offload_param`` (stage 3) moves the parameter partition.
- Activations grow linearly in mbs: ``activation_mem_per_gpu`` measured by DeepSpeed at mbs=1
  (``model_info.json``) times mbs.
- ``overhead_bytes``: what a rank holds before any of the above (CUDA context, or on CPU the
  process's own data: Python, torch, the communication backend). Calibrated from the profile run.

Not counted: ``allgather_bucket_size`` (ZeRO 1/2 all-gather shards in place), temporary buffers
of the optimizer step, allocator fragmentation. The search treats the estimate as a guide: the
micro-batch search may go above it when it proves cautious.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotune.deepspeed.config import precision

# DeepSpeed defaults (deepspeed/runtime/zero/config.py, engine.py).
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
DEFAULT_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000

_OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "lamb": 8, "onebitadam": 8,
                          "zerooneadam": 8, "onebitlamb": 8, "sgd": 4, "adagrad": 4, "lion": 4, "muon": 4}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device by kind; ``total`` is their sum."""

    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.buffers + self.activations
                + self.overhead)


def optimizer_state_bytes(ds_config: dict[str, Any]) -> int:
    """Bytes of optimizer state per parameter, not counting an fp32 master copy (8 for Adam).

    An unknown or absent optimizer counts as Adam, the common and the larger case.
    """
    opt = ds_config.get("optimizer") or {}
    name = str(opt.get("type", "adam")).lower().replace("_", "").replace("-", "")
    return _OPTIMIZER_STATE_BYTES.get(name, 8)


@dataclass(frozen=True)
class MemoryModel:
    """Per-device memory of a model under a ds_config.

    Args:
        num_params: parameters of the whole model, over all model-parallel ranks (DeepSpeed's
            ``model_info.num_params``).
        activation_bytes_per_sample: activation memory per device at mbs=1, bytes
            (DeepSpeed's ``model_info.activation_mem_per_gpu``).
        dp_world_size: data-parallel world size N (ranks / mp_size).
        mp_size: model-parallel size; parameters per device are ``num_params / mp_size``.
        overhead_bytes: fixed bytes per rank before model states (see module docstring).
    """

    num_params: int
    activation_bytes_per_sample: int
    dp_world_size: int
    mp_size: int = 1
    overhead_bytes: int = 0

    def breakdown(self, ds_config: dict[str, Any], mbs: int | None = None) -> MemoryBreakdown:
        """Bytes per device for ``ds_config`` at micro batch size ``mbs``.

        ``mbs`` defaults to the config's ``train_micro_batch_size_per_gpu`` (1 when absent).
        """
        if mbs is None:
            mbs = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
        zero = ds_config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0)) if not isinstance(zero.get("stage"), (list, str)) else 0
        psi = self.num_params / self.mp_size
        n = self.dp_world_size
        b = 4 if precision(ds_config) == "fp32" else 2
        k = optimizer_state_bytes(ds_config)
        offload_opt = _offloaded(zero.get("offload_optimizer")) and stage >= 1
        offload_param = _offloaded(zero.get("offload_param")) and stage == 3
        master = 0 if (stage == 0 and b == 4) else 4
        contiguous = bool(zero.get("contiguous_gradients", True))
        bucket = int(float(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE)))

        if stage == 0:
            params, grads, optim = b * psi, b * psi, (k + master) * psi
            buffers = b * min(psi, STAGE0_ALLREDUCE_ELEMENTS)
        else:
            live = float(zero.get("stage3_max_live_parameters", DEFAULT_STAGE3_MAX_LIVE_PARAMETERS))
            if stage == 3:
                params = b * min(psi, live) + (0 if offload_param else b * psi / n)
            else:
                params = b * psi
            grads = (b * psi if stage == 1 else b * psi / n) + (0 if offload_opt else 4 * psi / n)
            optim = 0 if offload_opt else (k + master) * psi / n
            if stage == 3:
                buffers = b * bucket if contiguous else 0
            else:
                overlap = bool(zero.get("overlap_comm", False))
                buffers = b * bucket * (2 if overlap else 1) if contiguous else 0
        return MemoryBreakdown(parameters=int(params), gradients=int(grads), optimizer_states=int(optim),
                               buffers=int(buffers), activations=int(self.activation_bytes_per_sample * mbs),
                               overhead=int(self.overhead_bytes))

    def bytes_per_device(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """Total bytes per device (see :meth:`breakdown`)."""
        return self.breakdown(ds_config, mbs).total

    def fits(self, ds_config: dict[str, Any], budget_bytes: int, mbs: int | None = None) -> bool:
        """True when the estimate for ``ds_config`` at ``mbs`` is within ``budget_bytes`` per device."""
        return self.bytes_per_device(ds_config, mbs) <= budget_bytes

    def max_mbs(self, ds_config: dict[str, Any], budget_bytes: int, cap: int = 1024) -> int:
        """Largest mbs whose estimate fits in ``budget_bytes`` (at most ``cap``); 0 when none fits."""
        fixed = self.bytes_per_device(ds_config, mbs=0)
        if fixed > budget_bytes:
            return 0
        if self.activation_bytes_per_sample <= 0:
            return cap
        return int(min(cap, (budget_bytes - fixed) // self.activation_bytes_per_sample))

    def calibrated(self, ds_config: dict[str, Any], measured_peak_bytes: int, mbs: int = 1) -> "MemoryModel":
        """A copy whose ``overhead_bytes`` makes the estimate of ``ds_config`` equal a measured peak.

        Used with the profile run: overhead = measured peak - model estimate without overhead
        (never negative).
        """
        base = MemoryModel(self.num_params, self.activation_bytes_per_sample, self.dp_world_size, self.mp_size, 0)
        overhead = max(0, int(measured_peak_bytes) - base.bytes_per_device(ds_config, mbs))
        return MemoryModel(self.num_params, self.activation_bytes_per_sample, self.dp_world_size, self.mp_size,
                           overhead)


def _offloaded(section: Any) -> bool:
    return isinstance(section, dict) and str(section.get("device", "none")).lower() in ("cpu", "nvme")
