"""The memory model: bytes per device (and host bytes per rank, for offload) for a ds_config, as pure arithmetic.

It prunes configs that cannot fit (never launched), gives each ZeRO stage's largest mbs (`MemoryModel.max_mbs`) and
serves ``zerotune estimate`` (D10, D110, D204, D320). Terms are per model-parallel rank, split over the DP world size
as the ZeRO stage says (`MemoryModel.breakdown`; options beyond ZeRO 0-3: `zerotune.model.zero_options`); activations
grow linearly in mbs. Not counted: allocator fragmentation and retention, the optimizer step's and the communication
backend's temporaries, which the calibration (`MemoryModel.calibrated`) and the online fit (`zerotune.model.online`)
absorb: use a calibrated model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zerotune.deepspeed import keys
from zerotune.deepspeed.config import precision
from zerotune.model.zero_options import ZeroOptions


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device by kind; ``total`` is their sum less ``apart``, plus ``host`` (what offload puts in host
    memory per rank) only with ``host_on_device`` (CPU ranks). ``apart``: the smaller of two components never alive
    at once, the activations and the reduction's flat copy made after the backward
    (`MemoryModel.copy_after_backward_bytes`)."""

    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int
    activations: int
    overhead: int
    host: int = 0
    apart: int = 0
    host_on_device: bool = False

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.buffers + self.activations
                + self.overhead - self.apart + (self.host if self.host_on_device else 0))

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer states on the device (what DeepSpeed's estimators count)."""
        return self.parameters + self.gradients + self.optimizer_states


def _number(value: Any, default: float) -> float:
    """A DeepSpeed numeric setting; ``"auto"``, a list of candidates or nothing gives DeepSpeed's default."""
    if isinstance(value, bool) or value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _offload_device(section: Any) -> str:
    return str(section.get("device", "none")).lower() if isinstance(section, dict) else "none"


@dataclass(frozen=True)
class MemoryModel:
    """Per-device memory of a model under a ds_config.

    Args:
        num_params, trainable_params: parameters over all model-parallel ranks, and those with ``requires_grad``
            (None: all), as DeepSpeed's ``model_info`` counts them.
        activation_bytes_per_sample: activation bytes per device at mbs 1 (``model_info.activation_mem_per_gpu``).
        dp_world_size, mp_size: data-parallel world size N (ranks / mp_size) and model-parallel size.
        overhead_bytes: fixed bytes per rank before model states (CUDA context and allocator reserve; on CPU the
            process's own data), set from the profile run's peak (`calibrated`), refitted online.
        persistent_params: stage-3 parameters in tensors of at most ``stage3_param_persistence_threshold``
            elements, which stay gathered (0: unknown).
        largest_layer_params: parameters of the largest module, which stage 3 gathers to run it (0: unknown).
        anchor: the calibration's ``(ds_config, peak bytes, mbs)`` (None: uncalibrated): the online fit's prior point.
        host_on_device: CPU ranks (``DS_ACCELERATOR=cpu``): what offload moves "to the host" stays in the rank's
            process under the same budget (``RLIMIT_DATA``), so `MemoryBreakdown.total` includes ``host``.
        checkpointed_activation_bytes_per_sample: the activation term with activation checkpointing
            (``ds_config[keys.CHECKPOINTING] is True``), bytes per sample; None: unknown (`activation_bytes`).
        activation_sp: the Ulysses degree (``sequence_parallel_size``) the activation figures hold for (1: the
            whole sample, as ``estimate`` gives it).
    """

    num_params: int
    activation_bytes_per_sample: int
    dp_world_size: int
    mp_size: int = 1
    overhead_bytes: int = 0
    trainable_params: int | None = None
    persistent_params: int = 0
    largest_layer_params: int = 0
    anchor: tuple[dict[str, Any], int, int] | None = dataclasses.field(default=None, compare=False, hash=False,
                                                                         repr=False)
    host_on_device: bool = False
    checkpointed_activation_bytes_per_sample: int | None = None
    activation_sp: int = 1

    def checkpointed(self, ds_config: dict[str, Any]) -> bool:
        """Whether ``ds_config`` sets `zerotune.deepspeed.keys.CHECKPOINTING` and the checkpointed term is known."""
        return ds_config.get(keys.CHECKPOINTING) is True and self.checkpointed_activation_bytes_per_sample is not None

    def activation_bytes(self, ds_config: dict[str, Any]) -> int:
        """The activation term of ``ds_config``, bytes per sample: ``checkpointed_activation_bytes_per_sample``
        where `checkpointed`, else ``activation_bytes_per_sample``; times ``activation_sp`` over the config's
        ``sequence_parallel_size`` (`zerotune.model.zero_options`)."""
        per_sample = (self.checkpointed_activation_bytes_per_sample if self.checkpointed(ds_config)
                      else self.activation_bytes_per_sample)
        return int(per_sample * self.activation_sp / ZeroOptions.of(ds_config).sp)

    def breakdown(self, ds_config: dict[str, Any], mbs: int | None = None) -> MemoryBreakdown:
        """Bytes per device for ``ds_config`` at ``mbs`` (default: the config's, 1 when absent or "auto"), by component.

        A stage that is not a number (``"all"``, a list) counts as 0. Psi = parameters per model-parallel rank, T = the
        trainable ones (frozen ones have no gradient, master copy or state), N = DP world size, b = bytes per element
        (2 for fp16/bf16, else 4), K = optimizer state bytes per parameter (8 for Adam; 4 for SGD with momentum,
        Adagrad, Lion), G = `gathered_params`, R = ``reduce_bucket_size`` (its ``b*R`` bucket is 0 without
        ``contiguous_gradients``), F = ``stage3_prefetch_bucket_size``, L = the largest module's parameters:

        stage  parameters     gradients              optimizer states       buffers
        0      b*Psi          b*T (+ 4*T fp16/bf16)  K*T (+ 4*T fp16/bf16)  b*min(T, 5e8)
        1      b*Psi          b*T + 4*T/N            (K + 4)*T/N            b*R (x2 overlap) + b*min(R, T)
        2      b*Psi          b*T/N + 4*T/N          (K + 4)*T/N            b*R (x2 overlap) + b*min(R, T)
        3      b*Psi/N + b*G  b*T/N + 4*T/N          (K + 4)*T/N            b*R + b*min(R, T) + b*min(G, max(L, F))

        Offload (``offload_optimizer`` cpu, stages 1-3) puts the fp32 master, the states and the fp32 gradient partition
        in ``host`` (stage 2 then keeps no gradient partition on the device, stage 3 moves its gradient partition
        buffer too), ``offload_param`` cpu stage 3's parameter partition; with nvme the master and states, or the
        parameter partition, go to disk, counted nowhere. Activations: `activation_bytes` times mbs.
        """
        if mbs is None:
            mbs = int(_number(ds_config.get("train_micro_batch_size_per_gpu"), 1))
        zero = ds_config.get("zero_optimization") or {}
        stage = int(_number(zero.get("stage"), 0)) if isinstance(zero, dict) else 0
        zero = zero if isinstance(zero, dict) else {}
        psi, t, n, options = self._sizes(ds_config)
        b = 4 if precision(ds_config) == "fp32" else 2
        k = keys.optimizer_state_bytes(ds_config) * options.states_scale
        opt_dev = _offload_device(zero.get("offload_optimizer")) if stage >= 1 else "none"
        param_dev = _offload_device(zero.get("offload_param")) if stage == 3 else "none"
        offload_opt = opt_dev in ("cpu", "nvme")
        contiguous = bool(zero.get("contiguous_gradients", True)) or offload_opt
        bucket = _number(zero.get("reduce_bucket_size"), keys.DEFAULT_REDUCE_BUCKET_SIZE)
        host = 0.0

        if stage == 0:
            params = b * psi
            step_grad = 4 * t if b == 2 else 0  # fused_optimizer.py:283-291
            master = 4 * t if b == 2 else 0  # fused_optimizer.py:100
            grads, optim = b * t + step_grad, k * t + master
            buffers = self.reduction_copy_bytes(ds_config)
        else:
            master = options.master_bytes * t / n  # stage3.py:1168-1170 (fp32 too: :1162-1163 is never true)
            fp32_grad = options.master_bytes * t / n
            if stage == 1:
                low_grads = b * t
            elif stage == 2:
                low_grads = 0 if offload_opt else b * t / n
            else:
                low_grads = b * t / n
            if stage == 3:
                partition = b * psi / n + (b * psi / options.hpz if options.hpz > 1 else 0)  # hpZ: zero_options
                params = b * self.gathered_params(ds_config) + (0 if param_dev != "none" else partition)
                host += partition if param_dev == "cpu" else 0
                if offload_opt:  # the gradient partition buffer is on the host too (stage3.py:333,791)
                    host += low_grads
                    low_grads = 0
            else:
                params = b * psi
            if offload_opt:  # offload_optimizer.ratio leaves a fraction f on the device (zero_options)
                f = options.device_fraction(t / n, self.largest_layer_params / n)
                grads, optim = low_grads + f * fp32_grad, f * (k * t / n + master)
                host += (1 - f) * (fp32_grad + ((k * t / n + master) if opt_dev == "cpu" else 0))
            else:
                grads, optim = low_grads + fp32_grad, k * t / n + master
            if stage == 3:
                buffers = b * bucket if contiguous else 0
            else:
                overlap = zero.get("overlap_comm")
                overlap = bool(overlap) if isinstance(overlap, bool) else False  # config.py:384-386: off below stage 3
                buffers = b * bucket * (2 if overlap else 1) if contiguous else 0
            buffers += self.reduction_copy_bytes(ds_config) + self.gather_copy_bytes(ds_config)
        activations = int(self.activation_bytes(ds_config) * mbs)
        return MemoryBreakdown(parameters=int(params), gradients=int(grads), optimizer_states=int(optim),
                               buffers=int(buffers), activations=activations,
                               overhead=int(self.overhead_bytes),
                               host=int(host), apart=min(activations, self.copy_after_backward_bytes(ds_config)),
                               host_on_device=self.host_on_device)

    def sub_groups(self, ds_config: dict[str, Any]) -> int:
        """ZeRO-3's optimizer sub-groups on a rank under ``ds_config`` (`ZeroOptions.sub_groups`): the granularity of
        ``offload_optimizer.ratio``, which offloads whole sub-groups."""
        _, t, n, options = self._sizes(ds_config)
        return options.sub_groups(t / n, self.largest_layer_params / n)

    def _sizes(self, ds_config: dict[str, Any]) -> tuple[float, float, float, ZeroOptions]:
        """``(Psi, T, N, options)``: parameters and trainable parameters per model-parallel rank and the DP world
        size, AutoTP's degree taken as model parallelism (`zerotune.model.zero_options`)."""
        options = ZeroOptions.of(ds_config)
        t = self.num_params if self.trainable_params is None else self.trainable_params
        mp = self.mp_size * options.tp
        return self.num_params / mp, t / mp, self.dp_world_size / options.tp, options

    def reduction_copy_bytes(self, ds_config: dict[str, Any]) -> int:
        """The flat copy of a gradient bucket that every stage's reduction makes in the backward pass,
        bytes: ``b*min(T, 5e8)`` at stage 0 (``engine.py:3795-3796``), ``b*min(R, T)`` at stages 1-3 with
        R = ``reduce_bucket_size``, 0 at stage 3 without ``reduce_scatter`` (reduced in place). Part of
        `MemoryBreakdown.buffers`; not in the profile run, which exits in its first forward (`profile_exit_bytes`)."""
        zero = ds_config.get("zero_optimization") or {}
        zero = zero if isinstance(zero, dict) else {}
        stage = int(_number(zero.get("stage"), 0))
        t = self._sizes(ds_config)[1]
        b = 4 if precision(ds_config) == "fp32" else 2
        if stage <= 0:
            return int(b * min(t, keys.STAGE0_ALLREDUCE_ELEMENTS))
        bucket = _number(zero.get("reduce_bucket_size"), keys.DEFAULT_REDUCE_BUCKET_SIZE)
        contiguous = bool(zero.get("contiguous_gradients", True)) or _offload_device(
            zero.get("offload_optimizer")) in ("cpu", "nvme")
        if stage >= 3 and zero.get("reduce_scatter", True) is False and contiguous:
            return 0  # stage3.py:1675-1677: all-reduced in place in the contiguous bucket
        return int(b * min(bucket, t))

    def copy_after_backward_bytes(self, ds_config: dict[str, Any]) -> int:
        """The reduction's flat copy (`reduction_copy_bytes`) when it is made after the backward pass, once
        autograd has freed the saved activations (``_backward_epilogue``, ``engine.py:3429-3431``, ``:3153-3165``),
        else 0: stage 0 and stage 1 without ``overlap_comm`` (``engine.py:3085-3095``), or a bucket holding every
        trainable parameter (R >= T), never full in the backward (``stage_1_and_2.py:1422``, ``stage3.py:1583``)."""
        zero = ds_config.get("zero_optimization") or {}
        zero = zero if isinstance(zero, dict) else {}
        stage = int(_number(zero.get("stage"), 0))
        t = self._sizes(ds_config)[1]
        overlap = zero.get("overlap_comm")
        overlap = overlap if isinstance(overlap, bool) else stage == 3  # zero/config.py:384-386
        after = (stage <= 0 or (stage == 1 and not overlap)
                 or _number(zero.get("reduce_bucket_size"), keys.DEFAULT_REDUCE_BUCKET_SIZE) >= t)
        return self.reduction_copy_bytes(ds_config) if after else 0

    def gather_copy_bytes(self, ds_config: dict[str, Any]) -> int:
        """Stage 3: the flat buffer of one coalesced all-gather, bytes, alive while its parameters are copied out
        (``zero/partition_parameters.py:1343``, ``:795``): a module's parameters or a prefetch (at most
        ``stage3_prefetch_bucket_size``, ``zero/partitioned_param_coordinator.py:452-476``),
        ``b*min(G, max(L, prefetch))``. 0 below stage 3; part of `MemoryBreakdown.buffers`."""
        zero = ds_config.get("zero_optimization") or {}
        zero = zero if isinstance(zero, dict) else {}
        if int(_number(zero.get("stage"), 0)) != 3:
            return 0
        b = 4 if precision(ds_config) == "fp32" else 2
        prefetch = _number(zero.get("stage3_prefetch_bucket_size"), keys.DEFAULT_STAGE3_PREFETCH_BUCKET_SIZE)
        return int(b * min(self.gathered_params(ds_config), max(self.largest_layer_params, prefetch)))

    def gathered_params(self, ds_config: dict[str, Any]) -> float:
        """Stage 3: parameters (elements) gathered on the device at once, G = min(Psi, max(L, min(max_live,
        max_reuse_distance + prefetch)) + persistent): a gathered parameter stays until no use comes within
        ``stage3_max_reuse_distance``, at most ``stage3_max_live_parameters`` at once, plus the prefetch and the
        persistent ones; DeepSpeed's defaults keep a model below 1e9 parameters wholly gathered."""
        zero = ds_config.get("zero_optimization") or {}
        psi = self._sizes(ds_config)[0]
        live = _number(zero.get("stage3_max_live_parameters"), keys.DEFAULT_STAGE3_MAX_LIVE_PARAMETERS)
        reuse = _number(zero.get("stage3_max_reuse_distance"), keys.DEFAULT_STAGE3_MAX_REUSE_DISTANCE)
        prefetch = _number(zero.get("stage3_prefetch_bucket_size"), keys.DEFAULT_STAGE3_PREFETCH_BUCKET_SIZE)
        return min(psi, max(self.largest_layer_params, min(live, reuse + prefetch)) + self.persistent_params)

    def bytes_per_device(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """Total bytes per device (see `breakdown`)."""
        return self.breakdown(ds_config, mbs).total

    def fits(self, ds_config: dict[str, Any], budget_bytes: int, mbs: int | None = None) -> bool:
        return self.bytes_per_device(ds_config, mbs) <= budget_bytes

    def host_fits(self, ds_config: dict[str, Any], host_memory_bytes: int | None, ranks_per_node: int) -> bool:
        """Whether offload's host bytes for ``ranks_per_node`` ranks (`MemoryBreakdown.host`, constant in mbs) fit
        ``host_memory_bytes`` per node; True when that is unknown (None) or the host is the device."""
        if host_memory_bytes is None or self.host_on_device:
            return True
        return self.breakdown(ds_config, mbs=0).host * ranks_per_node <= host_memory_bytes

    def max_mbs(self, ds_config: dict[str, Any], budget_bytes: int, cap: int = 1024) -> int:
        """Largest mbs whose estimate fits in ``budget_bytes`` (at most ``cap``); 0 when none fits."""
        fixed = self.bytes_per_device(ds_config, mbs=0)
        if fixed > budget_bytes:
            return 0
        per_sample = self.activation_bytes(ds_config)
        if per_sample <= 0:
            return cap
        # the activations share their room with the copy made after the backward pass (MemoryBreakdown.apart)
        room = budget_bytes - fixed + self.copy_after_backward_bytes(ds_config)
        return int(min(cap, room // per_sample))

    def profile_exit_bytes(self, ds_config: dict[str, Any], mbs: int = 1) -> int:
        """What the profile run holds per device when DeepSpeed's engine exits in its first forward
        (``autotuning.model_info.profile``): the estimate less what only the backward and the first optimizer step
        allocate. Always the reduction's flat copy. Stage 3: the device's optimizer states ``K*T/N`` and fp32
        gradient ``4*T/N`` (``stage3.py:1301-1370`` frees the gradient buffer it makes; torch creates the states at
        the first step), and the first forward's trace gathers ``b*min(Psi, L + persistent)`` with ``b*min(Psi, L)``
        of all-gather copy instead of ``b*G`` and `gather_copy_bytes`. Below stage 3: the gradients, the optimizer
        states and the reduction buckets; the parameters and the fp32 master copy remain."""
        full = self.breakdown(ds_config, mbs)
        zero = ds_config.get("zero_optimization") or {}
        full_total = full.total + full.apart - self.reduction_copy_bytes(ds_config)  # made in the backward pass
        if _offload_device(zero.get("offload_param")) == "none" and int(_number(zero.get("stage"), 0)) == 3:
            # The first forward records the trace: no prefetch (partitioned_param_coordinator.py:422) and
            # each module's parameters released after it (:498): L + persistent gathered, one module's copy.
            b = 4 if precision(ds_config) == "fp32" else 2
            psi = self._sizes(ds_config)[0]
            first = min(psi, self.largest_layer_params + self.persistent_params)
            full_total += int(b * first + b * min(psi, self.largest_layer_params)
                              - b * self.gathered_params(ds_config) - self.gather_copy_bytes(ds_config))
        if _offload_device(zero.get("offload_optimizer")) in ("cpu", "nvme"):
            return full_total
        _, t, n, options = self._sizes(ds_config)
        k = keys.optimizer_state_bytes(ds_config) * options.states_scale
        stage = int(_number(zero.get("stage"), 0))
        if stage < 3:
            # Below stage 3 only the parameters and the fp32 master copy exist at the first forward: the
            # gradients come in the backward (param.grad; the fp32 partition's gradient is freed at
            # initialization, stage_1_and_2.py:949-951), and so do the reduction buckets (setup_buckets,
            # stage_1_and_2.py:3256-3280); torch's optimizers create their states at the first step.
            buckets = full.buffers - self.reduction_copy_bytes(ds_config) - self.gather_copy_bytes(ds_config)
            states = k * t / (1 if stage == 0 else n)
            return int(full_total - full.gradients - states - buckets)
        return int(full_total - (k + options.master_bytes) * t / n)

    def profile_step_bytes(self, ds_config: dict[str, Any], mbs: int = 1) -> int:
        """What the profile run holds per device after its first backward (the probe runs one on CPU, D111): the
        estimate less the optimizer states torch creates at the first step (``K*T``, over N above stage 0;
        offloaded states are on the host already)."""
        zero = ds_config.get("zero_optimization") or {}
        stage = int(_number(zero.get("stage"), 0))
        if stage >= 1 and _offload_device(zero.get("offload_optimizer")) in ("cpu", "nvme"):
            return self.bytes_per_device(ds_config, mbs)
        _, t, n, options = self._sizes(ds_config)
        states = keys.optimizer_state_bytes(ds_config) * options.states_scale * t / (1 if stage == 0 else n)
        return int(self.bytes_per_device(ds_config, mbs) - states)

    def calibrated(self, ds_config: dict[str, Any], measured_peak_bytes: int, mbs: int = 1,
                   after_backward: bool = False) -> "MemoryModel":
        """A copy whose ``overhead_bytes`` (never negative) makes the estimate of ``ds_config`` at ``mbs`` equal a
        measured peak. A profile run's config (``autotuning.model_info.profile``) is estimated by `profile_exit_bytes`,
        or with ``after_backward`` (a peak after the probe's first backward) by `profile_step_bytes`."""
        base = dataclasses.replace(self, overhead_bytes=0)
        profiling = bool(((ds_config.get("autotuning") or {}).get("model_info") or {}).get("profile"))
        estimate = (base.profile_step_bytes(ds_config, mbs) if profiling and after_backward
                    else base.profile_exit_bytes(ds_config, mbs) if profiling else base.bytes_per_device(ds_config, mbs))
        return dataclasses.replace(self, overhead_bytes=max(0, int(measured_peak_bytes) - estimate),
                                   anchor=(ds_config, int(measured_peak_bytes), mbs))
