"""SIMULATED: an analytic model of one DeepSpeed training step of a transformer on a GPU cluster.

Nothing here is a measurement. It is a documented, deterministic stand-in for a real cluster so
that search quality can be compared at scales (hundreds of GPUs, 70B parameters) that are not
available; every number it produces is labelled SIMULATED by the benchmark that prints it.

What is modelled, per data-parallel (DP) rank, in bytes and seconds (Ψ = parameters, N = DP world
size = all GPUs, b = 2 bytes for fp16/bf16 parameters and gradients, s = sequence length,
h = hidden size, L = layers, V = vocabulary):

Memory (:meth:`Simulator.memory`), the terms of the ZeRO paper (Rajbhandari et al. 2020, sec. 5.1:
``2Ψ + 2Ψ + KΨ`` with K = 12 for mixed-precision Adam, partitioned over N by stage) and the same
terms as ``zerotune/memory.py``, plus what a real allocator adds:

==========  =========================  ================================  =============  =====================
ZeRO stage  fp16 parameters            gradients                         optimizer (K)  DeepSpeed buffers
==========  =========================  ================================  =============  =====================
0           2Ψ                         2Ψ                                12Ψ            2·min(Ψ, 5e8) all-reduce
1           2Ψ                         2Ψ + 4Ψ/N (fp32 partition)        12Ψ/N          2·rbs (×2 overlap_comm)
2           2Ψ                         2Ψ/N + 4Ψ/N                       12Ψ/N          2·rbs (×2 overlap_comm)
3           2Ψ/N + 2·min(Ψ, live)      2Ψ/N + 4Ψ/N                       12Ψ/N          2·rbs
==========  =========================  ================================  =============  =====================

(rbs = ``reduce_bucket_size``, live = ``stage3_max_live_parameters``; ``offload_optimizer`` removes
the optimizer states and the fp32 gradient partition, ``offload_param`` the stage-3 partition; bf16 master
weights and states make K 6 and the gradient partition 2Ψ/N; AutoTP t, stages 0-2, puts Ψ/t on a rank,
partitioned over N/t, and divides the layers' FLOPs and most of their activations by t, for four
activation-sized all-reduces per layer and micro-step on NVLink, six with checkpointing:
:meth:`Simulator.tp_all_reduce_s`; its t ranks hold one batch. Ulysses sp (``sequence_parallel_size``) puts 1/sp of
each sequence on a rank, dividing its activations and FLOPs by sp, for four all-to-alls per layer forward and four
backward of its shard's ``2·mbs·(s/sp)·h`` bytes (Jacobs et al. 2023, DeepSpeed-Ulysses, sec. 3), on NVLink within
a node: :meth:`Simulator.ulysses_all_to_all_s`; its sp ranks hold one batch. ``offload_optimizer.ratio`` r at
stage 3 keeps ``int((1 - r)·G)`` of a rank's G sub-groups (of ``sub_group_size``) on the device, their states and
fp32 gradients there and their Adam step on it, the others' on the host: :meth:`ZeroSettings.device_share`. ZeRO++
(Wang et al. 2023) at stage 3: hpZ h adds a secondary partition ``2Ψ/h`` and gathers the backward's parameters over a
node's h ranks on NVLink; qwZ halves the forward all-gathers' bytes (int8), qgZ quarters the gradients' (int4).)
Activations per sample follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4.1) with flash attention (no ``5·a·s²`` term): ``s·(11h + 3h + 4·ffn)``
bytes per layer (``34·s·h`` for ffn = 4h), plus the logits and loss (``6·s·V``). With activation
checkpointing a layer keeps only its fp16 input (``2·s·h``) and one layer is recomputed at a time
in the backward pass (its full activations are live then, and are NOT seen by DeepSpeed's profile,
which measures the forward pass only; zerotune's probe runs each checkpointed region once more with
gradients in its profile run and counts them: :meth:`Simulator.probe_activations`). On top: the CUDA
context and NCCL buffers (:attr:`Cluster.context_bytes`) and allocator fragmentation
(:data:`FRAGMENTATION` of activations and buffers). A config whose total exceeds the device memory fails as an OOM.

Step time (:meth:`Simulator.step`), for ``gas`` micro-steps of ``mbs`` samples:

- compute: FLOPs per sample ``6·s·Ψ_layers + 12·L·s²·h + 6·s·V·h`` (×4/3 on the layers with
  activation checkpointing) over the device's peak times an efficiency that grows with the
  tokens per micro-step ``t = mbs·s`` and with h: ``mfu_max · h/(h+640) · t/(t+1024)``, plus a
  fixed launch overhead per layer and micro-step (and ZeRO-3's per-module hooks);
- communication volume per step from the ZeRO paper (sec. 7): stage 0 all-reduces the fp16
  gradients (2Ψ elements moved per rank, ring), stages 1 and 2 reduce-scatter them (Ψ) and
  all-gather the updated parameters (Ψ): 2Ψ, like all-reduce; stage 3 all-gathers the parameters
  in the forward and again in the backward pass and reduce-scatters the gradients: 3Ψ. A ring
  collective over N ranks moving M bytes takes ``(N-1)/N · M / B`` per reduce-scatter or
  all-gather (twice that for all-reduce), with B = the per-GPU NVLink bandwidth on one node and
  ``min(NVLink, the node's NIC bandwidth)`` across nodes, plus a latency per collective call
  (``α_intra·log2(8) + 2·α_inter·log2(nodes)``, tree-like) times the number of buckets;
- when it happens: stages 0 and 1 reduce once per step (at the gradient-accumulation boundary),
  stage 2 reduce-scatters every micro-step, stage 3 gathers and reduce-scatters every micro-step;
- overlap: with ``overlap_comm`` the gradient reduction hides behind the backward pass (90% of it
  usable) except the last bucket (``rbs/Ψ`` of the volume); stage-3 parameter gathers are
  prefetched behind the forward and backward compute except the first prefetch bucket; stage 0
  and non-overlapped reductions are exposed;
- optimizer step: memory-bound Adam over the rank's partition (32 bytes per parameter of HBM
  traffic), or CPU-Adam plus PCIe traffic with ``offload_optimizer``;
- memory pressure: above 92% of device memory the caching allocator flushes and retries
  (DeepSpeed warns "pytorch allocator cache flushes since last step ... detrimental to
  performance"): compute slows by up to 25% at 100%;
- seeded noise, fresh on every run, as real runs vary: each run of a config draws a run-to-run
  log-normal factor on its step time (σ = ``noise_level``, 1% by default), and each step of each
  rank a log-normal jitter (the same σ); the k-th run of a config in a scenario draws the same
  numbers whichever tuner runs it (seeded by scenario, config and k; :meth:`Simulator.reset_runs`
  between tuners restarts k), so results repeat.

DeepSpeed's own metrics (``engine._autotuning_exit``): ``latency`` = microseconds per global step
(``gas`` micro-steps), ``throughput`` = ``train_batch_size / latency`` in samples/s,
``FLOPS_per_gpu``.

What a run reports (:meth:`Simulator.run`): the step probe's stream for :data:`PROBE_RANKS` ranks
(``probe.rank<R>.jsonl`` records, as :mod:`zerotune.probe` writes them: steps 1 to
``end_profile_step + 1``, step 1 three times as long as warm-up; ``boundary_s``, what the probe
times once per step, is the exposed boundary communication plus the optimizer step, without
ZeRO-1's reduction in the gradient hooks under ``overlap_comm``, with the step's noise), and DeepSpeed's ``metrics.json``
from rank 0's steps ``start_profile_step..end_profile_step``.

Duration of a simulated experiment (:meth:`Simulator.run`): start-up (launcher, NCCL rendezvous,
model construction: ``30 + 2·log2(GPUs) + 2·Ψ/1e9`` s) plus ``end_profile_step + 1`` measured
steps and two steps of warm-up; an OOM at initialisation costs the start-up, one in the first
step the start-up and one step; the profile run costs the start-up and one forward pass.
"""
from __future__ import annotations

import hashlib
import math
import random
import threading
from dataclasses import dataclass
from typing import Any

GiB = 2**30

FRAGMENTATION = 0.08
"""Allocator fragmentation: extra bytes as a fraction of activations and communication buffers."""
PRESSURE_START = 0.92
"""Fraction of device memory above which the allocator starts flushing its cache."""
PRESSURE_MAX_SLOWDOWN = 0.25
"""Compute slowdown at 100% of device memory (quadratic from :data:`PRESSURE_START`)."""
NOISE_LEVEL = 0.01
"""Default log-normal sigma of the run-to-run factor and of the per-step jitter on the step time."""

PROBE_RANKS = 2
"""Ranks whose step streams a SIMULATED run reports (the slowest of all would need every rank)."""

WARMUP_STEP_FACTOR = 3.0
"""Step 1 of a run takes this many steps' time (allocations, compilation)."""
OVERLAP_EFFICIENCY = 0.9
"""Fraction of a compute window that can hide communication."""
ADAM_HBM_BYTES_PER_PARAM = 32
"""HBM traffic of one fused Adam update per parameter (fp32 grad, master, m, v read and written)."""

# DeepSpeed defaults (deepspeed/runtime/zero/config.py, engine.py).
DEFAULT_BUCKET = 500_000_000
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_MAX_LIVE = 1_000_000_000
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class Device:
    """One GPU model (SIMULATED figures, close to public data sheets).

    Attributes:
        name: e.g. ``A100-80GB``.
        peak_flops: dense fp16/bf16 tensor-core peak, FLOP/s.
        memory_bytes: device memory, bytes.
        hbm_bytes_per_s: memory bandwidth, bytes/s.
        nvlink_bytes_per_s: achievable per-GPU collective (bus) bandwidth inside a node, bytes/s.
        mfu_max: model-FLOPs utilisation reached by large GEMMs.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    mfu_max: float


@dataclass(frozen=True)
class Interconnect:
    """The network between nodes.

    Attributes:
        name: e.g. ``IB 8x200G``.
        bytes_per_s: achievable bandwidth of all of a node's NICs together, bytes/s.
        latency_s: per-hop latency of a collective step, seconds.
    """

    name: str
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` nodes of ``gpus_per_node`` identical devices.

    Attributes:
        context_bytes: per-GPU memory taken before any tensor (CUDA context, NCCL buffers).
        intra_latency_s: per-hop latency inside a node.
        pcie_bytes_per_s: host-device bandwidth per GPU (offload).
        cpu_adam_params_per_s: DeepSpeedCPUAdam throughput per GPU's share of the host cores.
    """

    device: Device
    num_nodes: int
    interconnect: Interconnect
    gpus_per_node: int = 8
    context_bytes: int = int(1.25 * GiB)
    intra_latency_s: float = 8e-6
    pcie_bytes_per_s: float = 24e9
    cpu_adam_params_per_s: float = 2.5e8

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def bus_bytes_per_s(self) -> float:
        """Ring bandwidth B: NVLink on one node; the slower of NVLink and the node's NICs across nodes."""
        if self.num_nodes == 1:
            return self.device.nvlink_bytes_per_s
        return min(self.device.nvlink_bytes_per_s, self.interconnect.bytes_per_s)

    @property
    def collective_latency_s(self) -> float:
        """Latency of one collective call: tree-like over GPUs in a node and over nodes."""
        lat = self.intra_latency_s * math.log2(self.gpus_per_node)
        if self.num_nodes > 1:
            lat += 2 * self.interconnect.latency_s * math.log2(self.num_nodes)
        return lat


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer (GPT-3 / Llama shapes).

    Attributes:
        kv_fraction: key/value projection width over h (grouped-query attention: 8 KV heads of 64
            query heads = 0.125).
        gated_mlp: SwiGLU MLP (three ffn matrices instead of two).
        tied_embeddings: input and output embeddings share one matrix.
        activation_checkpointing: the training script checkpoints every layer (a property of the
            workload, not a tuned knob).
    """

    name: str
    num_layers: int
    hidden: int
    ffn_hidden: int
    vocab: int
    seq_len: int = 2048
    kv_fraction: float = 1.0
    gated_mlp: bool = False
    tied_embeddings: bool = True
    activation_checkpointing: bool = False

    @property
    def layer_params(self) -> int:
        h = self.hidden
        attn = 2 * h * h + 2 * h * int(h * self.kv_fraction)
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        return attn + mlp

    @property
    def num_params(self) -> int:
        """Ψ: layers plus embeddings (one matrix when tied, two otherwise)."""
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + emb

    @property
    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample (×4/3 on the layers with checkpointing)."""
        s, h, L = self.seq_len, self.hidden, self.num_layers
        layers = 6 * s * L * self.layer_params + 12 * L * s * s * h
        if self.activation_checkpointing:
            layers *= 4 / 3
        return layers + 6 * s * self.vocab * h

    @property
    def layer_activation_bytes(self) -> int:
        """Activations one layer saves for backward, one sample (Korthikanti et al., flash attention)."""
        return self.tp_layer_activation_bytes(1)

    def tp_layer_activation_bytes(self, tp: int) -> int:
        """`layer_activation_bytes` on a rank of a tensor-parallel group of ``tp``: the layer norms' inputs,
        the dropout masks and the attention input (``10·s·h``) whole, the rest over ``tp`` (Korthikanti et al.
        2022, sec. 4.2, without sequence parallelism)."""
        s, h = self.seq_len, self.hidden
        ffn_terms = 6 if self.gated_mlp else 4
        return int(s * (10 * h + (4 * h + ffn_terms * self.ffn_hidden) / tp))

    def tp_peak_activation_bytes(self, tp: int) -> int:
        """`peak_activation_bytes` on a rank of a tensor-parallel group of ``tp`` (the logits whole)."""
        layer = self.tp_layer_activation_bytes(tp)
        if self.activation_checkpointing:
            return self.num_layers * 2 * self.seq_len * self.hidden + self.logits_bytes + layer
        return self.num_layers * layer + self.logits_bytes

    def tp_flops_per_sample(self, tp: int) -> float:
        """`flops_per_sample` on a rank of a tensor-parallel group of ``tp``: the layers' over ``tp``, the
        logits' whole (AutoTP keeps the output embedding on every rank)."""
        logits = 6 * self.seq_len * self.vocab * self.hidden
        return (self.flops_per_sample - logits) / tp + logits

    @property
    def logits_bytes(self) -> int:
        return 6 * self.seq_len * self.vocab

    @property
    def forward_activation_bytes(self) -> int:
        """What DeepSpeed's profile run measures at mbs=1: memory allocated across the forward."""
        if self.activation_checkpointing:
            return self.num_layers * 2 * self.seq_len * self.hidden + self.logits_bytes
        return self.num_layers * self.layer_activation_bytes + self.logits_bytes

    @property
    def peak_activation_bytes(self) -> int:
        """Peak activation bytes per sample in a training step (the recomputed layer included)."""
        extra = self.layer_activation_bytes if self.activation_checkpointing else 0
        return self.forward_activation_bytes + extra


@dataclass(frozen=True)
class ZeroSettings:
    """The settings of a ds_config the simulator reads, with DeepSpeed's defaults filled in."""

    stage: int
    mbs: int
    gas: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    max_live_parameters: int
    offload_optimizer: bool
    offload_param: bool
    tp: int = 1  # tensor_parallel.autotp_size (stages 0-2)
    sp: int = 1  # sequence_parallel_size (Ulysses)
    offload_ratio: float = 1.0  # offload_optimizer.ratio (stage 3): the share of optimizer sub-groups on the host
    sub_group_size: int = 1_000_000_000  # zero_optimization.sub_group_size, elements
    hpz: int = 1  # zero_hpz_partition_size (ZeRO++ hpZ, stage 3): a secondary parameter partition over hpz ranks
    qw: bool = False  # zero_quantized_weights (ZeRO++ qwZ, stage 3): int8 forward all-gathers
    qg: bool = False  # zero_quantized_gradients (ZeRO++ qgZ, stage 3): int4 gradient reduce-scatters
    bf16_states: bool = False  # bf16.bf16_master_weights_and_grads with bf16_optimizer_states (stages 1-3)

    @classmethod
    def from_config(cls, ds_config: dict[str, Any]) -> "ZeroSettings":
        zero = ds_config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))

        def offloaded(key: str) -> bool:
            sec = zero.get(key)
            return isinstance(sec, dict) and str(sec.get("device", "none")).lower() in ("cpu", "nvme")

        overlap = zero.get("overlap_comm")
        bf16 = ds_config.get("bf16") or {}
        tp = int((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 1)
        return cls(
            stage=stage,
            mbs=int(ds_config.get("train_micro_batch_size_per_gpu", 1)),
            gas=int(ds_config.get("gradient_accumulation_steps", 1)),
            overlap_comm=(stage == 3) if overlap is None else bool(overlap),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            reduce_scatter=bool(zero.get("reduce_scatter", True)),
            reduce_bucket_size=int(float(zero.get("reduce_bucket_size", DEFAULT_BUCKET))),
            allgather_bucket_size=int(float(zero.get("allgather_bucket_size", DEFAULT_BUCKET))),
            prefetch_bucket_size=int(float(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET))),
            max_live_parameters=int(float(zero.get("stage3_max_live_parameters", DEFAULT_MAX_LIVE))),
            offload_optimizer=stage >= 1 and offloaded("offload_optimizer"),
            offload_param=stage == 3 and offloaded("offload_param"),
            tp=tp if stage <= 2 else 1,
            sp=int(ds_config.get("sequence_parallel_size") or 1),
            offload_ratio=float((zero.get("offload_optimizer") or {}).get("ratio", 1.0)) if stage == 3 else 1.0,
            sub_group_size=int(float(zero.get("sub_group_size", 1_000_000_000))),
            hpz=int(zero.get("zero_hpz_partition_size", 1)) if stage == 3 else 1,
            qw=stage == 3 and bool(zero.get("zero_quantized_weights")),
            qg=stage == 3 and bool(zero.get("zero_quantized_gradients")),
            bf16_states=stage >= 1 and bool(bf16.get("bf16_master_weights_and_grads"))
            and bool(bf16.get("bf16_optimizer_states")),
        )

    def device_share(self, psi: float, n: float) -> float:
        """The share of the optimizer's sub-groups an ``offload_optimizer`` leaves on the device: DeepSpeed's
        ``int((1 - ratio) * G) / G`` for G = ceil(Ψ/N / sub_group_size) sub-groups (``zero/stage3.py``); 1 without
        offload, 0 for a full one."""
        if not self.offload_optimizer:
            return 1.0
        groups = max(1, math.ceil(psi / n / self.sub_group_size))
        return int((1 - self.offload_ratio) * groups) / groups

    def key(self) -> str:
        """What identifies the config for the simulator (and seeds its noise); a setting at its default (no AutoTP,
        no bf16 states) is left out, so a config without them draws the noise it drew before they were modelled."""
        defaults = {"tp": 1, "sp": 1, "bf16_states": False, "offload_ratio": 1.0, "sub_group_size": 1_000_000_000,
                    "hpz": 1, "qw": False, "qg": False}
        return "|".join(f"{k}={v}" for k, v in sorted(self.__dict__.items()) if defaults.get(k, object()) != v)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU by kind."""

    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int
    activations: int
    context: int
    fragmentation: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        return self.model_states + self.buffers + self.activations + self.context + self.fragmentation


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one global step (``gas`` micro-steps): ``latency_s`` = gas × (compute + exposed
    micro-step communication) + exposed boundary communication + optimizer, times ``noise``."""

    compute_s: float  # per micro-step, memory pressure included
    exposed_comm_micro_s: float  # per micro-step
    exposed_comm_boundary_s: float  # once per step
    optimizer_s: float  # once per step
    pressure: float  # compute slowdown factor (>= 1)
    noise: float  # multiplicative factor on the step time (1.0 when noise-free)
    samples: int  # per step, all GPUs
    flops_per_sample: float
    num_gpus: int
    latency_s: float
    probed_boundary_s: float = 0.0  # once per step, as the step probe times it (boundary_s), times noise
    tp: int = 1  # AutoTP degree: DeepSpeed's train_batch_size counts samples x tp at ZeRO 0-2 (D331)

    @property
    def throughput(self) -> float:
        """Samples per second (all GPUs)."""
        return self.samples / self.latency_s

    @property
    def flops_per_gpu(self) -> float:
        return self.flops_per_sample * self.samples / self.num_gpus / self.latency_s


@dataclass(frozen=True)
class Outcome:
    """A simulated experiment: ``status`` is ``ok``, ``oom`` (``oom_phase`` ``init`` or ``step``)."""

    status: str
    duration_s: float
    memory: MemoryBreakdown
    step: StepBreakdown | None
    oom_phase: str = ""
    streams: dict[int, list[dict[str, Any]]] | None = None  # the probe's records per rank (ok runs)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def model_state_bytes(z: ZeroSettings, psi: int, n: int) -> tuple[float, float, float]:
    """(fp16 parameters, gradients, optimizer states) bytes per GPU for Ψ = ``psi`` over N = ``n``.

    The ZeRO paper's ``2Ψ + 2Ψ + 12Ψ`` partitioned by stage, with DeepSpeed's fp32 gradient
    partition (``4Ψ/N``, stages 1-3) and stage 3's gathered live parameters
    (``2·min(Ψ, stage3_max_live_parameters)``); offload removes what it moves to the host. AutoTP t:
    each rank holds Ψ/t (every weight sharded, Megatron's layout: Shoeybi et al. 2019) and ZeRO
    partitions that over the DP world N/t. bf16 master weights and states: 6 bytes a parameter
    (master, Adam's two moments) instead of 12, and a 2-byte gradient partition instead of 4.
    """
    psi, n = psi / z.tp, n / z.tp
    k, g = (6, 2) if z.bf16_states else (12, 4)
    if z.stage == 0:
        return 2 * psi, 2 * psi, 12 * psi
    if z.stage < 3:
        params = 2 * psi
    else:
        params = (0 if z.offload_param else 2 * psi / n) + 2 * min(psi, z.max_live_parameters)
        params += 2 * psi / z.hpz if z.hpz > 1 else 0  # hpZ's secondary partition, in the parameters' dtype
    keep = z.device_share(psi, n)  # offload_optimizer.ratio: the sub-groups left on the device
    grads = (2 * psi if z.stage == 1 else 2 * psi / n) + keep * g * psi / n
    optim = keep * k * psi / n
    return params, grads, optim


class Simulator:
    """SIMULATED experiments of one workload (model × cluster) with a seeded noise term.

    Args:
        model: the transformer the training script trains.
        cluster: where it runs; every experiment uses all of its GPUs (DP world size = GPUs).
        seed: seeds the noise.
        end_profile_step: DeepSpeed's ``autotuning.end_profile_step`` (steps measured before exit).
        noise_level: log-normal sigma of the run-to-run factor and of the per-step jitter.
        start_profile_step: DeepSpeed's ``autotuning.start_profile_step`` (its metric's first step).
    """

    def __init__(self, model: Transformer, cluster: Cluster, seed: int = 0, end_profile_step: int = 5,
                 noise_level: float = NOISE_LEVEL, start_profile_step: int = 3):
        self.model = model
        self.cluster = cluster
        self.seed = seed
        self.end_profile_step = end_profile_step
        self.start_profile_step = start_profile_step
        self.noise_level = noise_level
        self._runs: dict[str, int] = {}  # config key -> runs so far
        self._lock = threading.Lock()

    # -- memory ---------------------------------------------------------------------------------
    def memory(self, ds_config: dict[str, Any]) -> MemoryBreakdown:
        """Bytes per GPU of ``ds_config`` (see the module docstring)."""
        z = ZeroSettings.from_config(ds_config)
        psi, n = self.model.num_params, self.cluster.num_gpus
        params, grads, optim = model_state_bytes(z, psi, n)
        if z.stage == 0:
            buffers = 2 * min(psi // z.tp, STAGE0_ALLREDUCE_ELEMENTS)
        elif not z.contiguous_gradients:
            buffers = 0
        elif z.stage == 3:
            buffers = 2 * z.reduce_bucket_size
        else:
            buffers = 2 * z.reduce_bucket_size * (2 if z.overlap_comm else 1)
        activations = self.model.tp_peak_activation_bytes(z.tp) * z.mbs // z.sp
        frag = FRAGMENTATION * (activations + buffers)
        return MemoryBreakdown(int(params), int(grads), int(optim), int(buffers), int(activations),
                               int(self.cluster.context_bytes), int(frag))

    def communication_bytes(self, ds_config: dict[str, Any]) -> float:
        """Bytes each rank sends per global step (ring collectives; the ZeRO paper's volumes).

        Stage 0: one all-reduce of the fp16 gradients, ``2·(N-1)/N·2Ψ``. Stages 1, 2: a
        reduce-scatter and a parameter all-gather, ``(N-1)/N·2Ψ`` each: the same 2Ψ elements
        (stage 2 reduce-scatters every micro-step). Stage 3: two parameter all-gathers and a
        reduce-scatter every micro-step, ``3·(N-1)/N·2Ψ`` per micro-step. ``reduce_scatter: false``
        all-reduces the gradients instead (twice the volume).
        """
        z = ZeroSettings.from_config(ds_config)
        psi, n = self.model.num_params, self.cluster.num_gpus
        one = (n - 1) / n * 2 * psi
        reduce = one * (1 if z.reduce_scatter else 2)
        if z.stage == 0:
            return 2 * one
        if z.stage == 1:
            return reduce + one
        if z.stage == 2:
            return z.gas * reduce + one
        return z.gas * (2 * one + reduce)

    def fits(self, ds_config: dict[str, Any]) -> bool:
        return self.memory(ds_config).total <= self.cluster.device.memory_bytes

    # -- time -----------------------------------------------------------------------------------
    def compute_s(self, mbs: int, tp: int = 1, sp: int = 1) -> float:
        """Seconds of forward + backward compute of one micro-step, no memory pressure (on a rank of a
        tensor-parallel group of ``tp``: its share of the FLOPs, with the efficiency of its narrower matrices; of a
        Ulysses group of ``sp``: 1/sp of the FLOPs, over its shard's tokens)."""
        m, d = self.model, self.cluster.device
        tokens = mbs * m.seq_len / sp
        width = m.hidden / tp
        eff = d.mfu_max * width / (width + 640) * tokens / (tokens + 1024)
        return mbs * m.tp_flops_per_sample(tp) / sp / (d.peak_flops * eff) + m.num_layers * 0.25e-3

    def ulysses_all_to_all_s(self, mbs: int, sp: int) -> float:
        """Seconds of one micro-step's Ulysses all-to-alls (Jacobs et al. 2023, sec. 3): q, k, v and the attention
        output, four per layer in the forward and four in the backward (four more with checkpointing), each moving
        (sp-1)/sp of the shard's ``2·mbs·(s/sp)·h`` bytes; on NVLink within a node, over the interconnect across
        nodes; never overlapped."""
        if sp == 1:
            return 0.0
        m, c = self.model, self.cluster
        count = (12 if m.activation_checkpointing else 8) * m.num_layers
        volume = (sp - 1) / sp * 2 * mbs * m.seq_len / sp * m.hidden
        link = c.device.nvlink_bytes_per_s if sp <= c.gpus_per_node else c.bus_bytes_per_s
        return count * (volume / link + c.intra_latency_s * math.log2(sp))

    def tp_all_reduce_s(self, mbs: int, tp: int) -> float:
        """Seconds of one micro-step's tensor-parallel all-reduces (Shoeybi et al. 2019, sec. 3): two per layer in
        the forward, two in the backward (two more with checkpointing, the recomputed forward's), each of the
        layer's output, ``2·mbs·s·h`` bytes, as a ring over ``tp`` ranks on NVLink; never overlapped."""
        if tp == 1:
            return 0.0
        m, c = self.model, self.cluster
        count = (6 if m.activation_checkpointing else 4) * m.num_layers
        volume = 2 * (tp - 1) / tp * 2 * mbs * m.seq_len * m.hidden
        return count * (volume / c.device.nvlink_bytes_per_s + 2 * c.intra_latency_s * math.log2(tp))

    def _collective_s(self, nbytes: float, calls: int, all_reduce: bool = False, ranks: int | None = None) -> float:
        """One ring reduce-scatter or all-gather (all-reduce: twice the volume) of ``nbytes`` over ``ranks``
        (default: every GPU)."""
        c = self.cluster
        n = ranks or c.num_gpus
        if n == 1:
            return 0.0
        volume = (2 if all_reduce else 1) * (n - 1) / n * nbytes
        return volume / c.bus_bytes_per_s + calls * c.collective_latency_s * (2 if all_reduce else 1)

    def _intra_collective_s(self, nbytes: float, calls: int, ranks: int) -> float:
        """One ring all-gather of ``nbytes`` over ``ranks`` GPUs of one node, on NVLink."""
        c = self.cluster
        return (ranks - 1) / ranks * nbytes / c.device.nvlink_bytes_per_s + calls * c.intra_latency_s * math.log2(ranks)

    @staticmethod
    def _exposed(comm_s: float, window_s: float, unhidden_fraction: float) -> float:
        """Communication left visible when it overlaps a compute window."""
        return max(comm_s - OVERLAP_EFFICIENCY * window_s, comm_s * min(1.0, unhidden_fraction))

    def step(self, ds_config: dict[str, Any], noise: float = 1.0) -> StepBreakdown:
        """Seconds of one global step of ``ds_config`` (see the module docstring), times ``noise``
        (a run's factor; 1.0: the noise-free ground truth)."""
        z = ZeroSettings.from_config(ds_config)
        m, c = self.model, self.cluster
        n, L, dp = c.num_gpus, m.num_layers, c.num_gpus // z.tp
        psi = m.num_params // z.tp  # a rank's shard; ZeRO reduces it over the DP world
        mem = self.memory(ds_config)
        frac = mem.total / c.device.memory_bytes
        pressure = 1 + PRESSURE_MAX_SLOWDOWN * (max(0.0, min(frac, 1.0) - PRESSURE_START) / (1 - PRESSURE_START)) ** 2
        compute = self.compute_s(z.mbs, z.tp, z.sp) * pressure
        if z.stage == 3:
            compute += L * 0.2e-3  # ZeRO-3 per-module pre/post hooks (host side)
        bwd_share = 3 / 4 if m.activation_checkpointing else 2 / 3
        fwd_window, bwd_window = compute * (1 - bwd_share), compute * bwd_share

        grad_bytes = 2 * psi * (0.25 if z.qg else 1)  # qgZ: int4 gradients (ZeRO++, Wang et al. 2023, sec. 4.3)
        rs_calls = math.ceil(psi / z.reduce_bucket_size)
        reduce = self._collective_s(grad_bytes, rs_calls, all_reduce=not z.reduce_scatter, ranks=dp)
        last_bucket = z.reduce_bucket_size / psi
        micro, boundary, hooks = self.tp_all_reduce_s(z.mbs, z.tp) + self.ulysses_all_to_all_s(z.mbs, z.sp), 0.0, 0.0
        if z.stage == 0:
            boundary = self._collective_s(grad_bytes, math.ceil(psi / STAGE0_ALLREDUCE_ELEMENTS), all_reduce=True,
                                          ranks=dp)
        elif z.stage in (1, 2):
            exposed = self._exposed(reduce, bwd_window, last_bucket) if z.overlap_comm else reduce
            if z.stage == 1:
                boundary += exposed
                hooks = exposed if z.overlap_comm else 0.0  # in the backward's gradient hooks: not probed
            else:
                micro += exposed
            boundary += self._collective_s(2 * psi, math.ceil(psi / z.allgather_bucket_size), ranks=dp)
        else:
            fetch_calls = max(math.ceil(psi / z.prefetch_bucket_size), 4 * L)
            gather = self._collective_s(2 * psi * (0.5 if z.qw else 1), fetch_calls)  # qwZ: int8 weights
            # hpZ: the backward gathers the secondary partition inside a node (ZeRO++, sec. 4.2)
            back = self._intra_collective_s(2 * psi, fetch_calls, z.hpz) if z.hpz > 1 else gather
            first = max(z.prefetch_bucket_size, m.layer_params) / psi
            micro += self._exposed(gather, fwd_window, first)
            if z.overlap_comm:
                micro += self._exposed(back + reduce, bwd_window, max(first, last_bucket))
            else:
                micro += self._exposed(back, bwd_window, first) + reduce
            if z.offload_param:
                micro += 2 * 2 * psi / n / c.pcie_bytes_per_s

        local = psi if z.stage == 0 else psi / dp
        keep = z.device_share(psi, dp)  # partial offload: the device's sub-groups step on it, one after another
        adam = ADAM_HBM_BYTES_PER_PARAM // (2 if z.bf16_states else 1)  # bf16 master and moments: half the traffic
        optimizer = keep * local * adam / c.device.hbm_bytes_per_s
        if z.offload_optimizer:
            optimizer += (1 - keep) * (local / c.cpu_adam_params_per_s + 6 * local / c.pcie_bytes_per_s)

        latency = z.gas * (compute + micro) + boundary + optimizer
        return StepBreakdown(compute_s=compute, exposed_comm_micro_s=micro, exposed_comm_boundary_s=boundary,
                             optimizer_s=optimizer, pressure=pressure, noise=noise,
                             samples=z.mbs * z.gas * dp // z.sp, flops_per_sample=m.flops_per_sample, num_gpus=n,
                             latency_s=latency * noise, probed_boundary_s=(boundary - hooks + optimizer) * noise,
                             tp=z.tp)

    def rng(self, ds_config: dict[str, Any]) -> random.Random:
        """The noise of the next run of ``ds_config``: seeded by scenario, resolved config and how
        many times it ran before (thread-safe), so the k-th run draws the same numbers whoever runs it."""
        key = ZeroSettings.from_config(ds_config).key()
        with self._lock:
            k = self._runs[key] = self._runs.get(key, 0) + 1
        digest = hashlib.sha256(f"{self.seed}|{key}|{k}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    def reset_runs(self) -> None:
        """Forget how many times each config ran: call it between two tuners, so each one's k-th run of
        a config draws the same noise (common random numbers), whatever the other tuner ran."""
        with self._lock:
            self._runs.clear()

    def streams(self, step: StepBreakdown, rng: random.Random, gas: int, peak_bytes: int,
                extra_steps: int = 0) -> dict[int, list[dict[str, Any]]]:
        """The probe's records of one run (see the module docstring), per simulated rank; with
        ``extra_steps`` more after ``end_profile_step`` (an extended run), drawn after all the others so
        the first ``end_profile_step + 1`` steps are the same either way."""
        out: dict[int, list[dict[str, Any]]] = {}
        ranks = range(min(PROBE_RANKS, step.num_gpus))
        for first, last in ((1, self.end_profile_step + 1), (self.end_profile_step + 2, self.end_profile_step + 1 + extra_steps)):
            for rank in ranks:
                records = out.setdefault(rank, [])
                t = records[-1]["t"] if records else 0.0
                for i in range(first, last + 1):
                    jitter = (WARMUP_STEP_FACTOR if i == 1 else 1.0) * rng.lognormvariate(0, self.noise_level)
                    step_s = step.latency_s * jitter
                    t += step_s
                    records.append({"rank": rank, "step": i, "t": t, "step_s": step_s,
                                    "boundary_s": step.probed_boundary_s * jitter, "micro_steps": gas,
                                    "train_batch_size": step.samples * step.tp, "peak_bytes": peak_bytes,
                                    **({"autotp_size": step.tp} if step.tp > 1 else {})})
        return out

    def throughput(self, ds_config: dict[str, Any]) -> float | None:
        """Noise-free samples/s of ``ds_config``, or None when it does not fit (the ground truth)."""
        if not self.fits(ds_config):
            return None
        return self.step(ds_config).throughput

    # -- experiments ----------------------------------------------------------------------------
    def startup_s(self) -> float:
        """Launcher, rendezvous and model construction before the first step."""
        return 30 + 2 * math.log2(self.cluster.num_gpus) + 2 * self.model.num_params / 1e9

    def run(self, ds_config: dict[str, Any], profile: bool = False, extra_steps: int = 0) -> Outcome:
        """One SIMULATED experiment of ``ds_config``: its outcome and how long it ran.

        Args:
            profile: DeepSpeed's model-info profile run (exits in the first forward pass).
            extra_steps: steps after ``end_profile_step`` (an extended run's engine exits that much
                later; :func:`zerotune.core.stopping.extended_end_step`).
        """
        mem = self.memory(ds_config)
        budget = self.cluster.device.memory_bytes
        if mem.total - mem.activations - mem.fragmentation > budget:
            return Outcome("oom", self.startup_s(), mem, None, oom_phase="init")
        rng = self.rng(ds_config)
        step = self.step(ds_config, noise=rng.lognormvariate(0, self.noise_level))
        if profile:
            z = ZeroSettings.from_config(ds_config)
            fwd = self.model.forward_activation_bytes * z.mbs // z.sp
            ok = mem.total - mem.activations - mem.fragmentation + fwd <= budget
            return Outcome("ok" if ok else "oom", self.startup_s() + step.compute_s / 3, mem, step,
                           oom_phase="" if ok else "step")
        if mem.total > budget:
            return Outcome("oom", self.startup_s() + step.latency_s, mem, step, oom_phase="step")
        streams = self.streams(step, rng, ZeroSettings.from_config(ds_config).gas, mem.total, extra_steps)
        duration = self.startup_s() + sum(r["step_s"] for r in streams[0]) + step.latency_s
        return Outcome("ok", duration, mem, step, streams=streams)

    def metrics(self, outcome: Outcome) -> dict[str, float]:
        """``metrics.json`` as DeepSpeed's engine writes it (``_autotuning_exit``), from rank 0's steps
        ``start_profile_step..end_profile_step``: latency in microseconds per global step, throughput
        in samples/s, FLOPS_per_gpu."""
        step = outcome.step
        window = [r["step_s"] for r in outcome.streams[0] if self.start_profile_step <= r["step"] <= self.end_profile_step]
        latency = sum(window) / len(window) if window else step.latency_s
        return {"latency": latency * 1e6, "throughput": step.samples * step.tp / latency,
                "FLOPS_per_gpu": step.flops_per_sample * step.samples / step.num_gpus / latency}

    def model_info(self, mbs: int = 1, sp: int = 1) -> dict[str, int]:
        """``model_info.json`` as DeepSpeed's engine writes it in a profile run at micro batch size ``mbs`` (and
        Ulysses degree ``sp``: a rank's share of each sequence)."""
        psi = self.model.num_params
        return {"num_params": psi, "trainable_num_params": psi,
                "activation_mem_per_gpu": self.model.forward_activation_bytes * mbs // sp, "rank": 0}

    def probe_activations(self, mbs: int = 1, sp: int = 1) -> dict[str, int]:
        """The ``activations.json`` zerotune's probe writes in a profile run at micro batch size ``mbs`` and Ulysses
        degree ``sp`` (:mod:`zerotune.probe.sitecustomize`): the bytes the forward saves for the backward pass and,
        with activation checkpointing, the most one checkpointed region (a layer) saves as it is recomputed."""
        m = self.model
        record = {"saved_bytes": m.forward_activation_bytes * mbs // sp, "micro_batch_size": mbs}
        if m.activation_checkpointing:
            record.update(recompute_bytes=m.layer_activation_bytes * mbs // sp, recompute_regions=m.num_layers)
        return record
