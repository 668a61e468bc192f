"""Model FLOPs utilisation (MFU): the FLOPs a run's tokens need by the model's shape, against the devices' peak.

Training FLOPs per token (forward and backward; PaLM, Chowdhery et al. 2022, appendix B): ``6 * N + 12 * L * H * T``,
``N`` the parameters a token runs through (a mixture of experts: ``N_all - R * (E - k) / E``, ``R`` the routed experts'
parameters, ``k`` of ``E`` run per token), ``L`` layers, ``H`` the hidden size, ``T`` tokens per sample (the attention
term, left out where ``L`` or ``H`` is unknown). Recomputation under checkpointing is not counted (model FLOPs, not
hardware FLOPs). MFU = tokens/s per device * FLOPs per token / the device's peak: ``--peak-tflops``, else
`PEAK_TFLOPS` by the device's name (dense 16-bit tensor peak, the vendor's datasheet); unknown on a CPU rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.model.zero_options import samples_per_step

__all__ = ["PEAK_TFLOPS", "FlopsModel", "active_params", "peak_tflops", "samples_per_s", "tokens_per_device"]

PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.0), (("H100", "PCIE"), 756.0), (("H100", "NVL"), 835.0), (("H100",), 989.0),
    (("H800",), 989.0), (("B200",), 2250.0), (("A100",), 312.0), (("A800",), 312.0), (("L40S",), 362.0),
    (("L40",), 181.0), (("L4",), 121.0), (("V100",), 125.0), (("MI300X",), 1307.0), (("MI250X",), 383.0))
"""Dense BF16 (V100: FP16) tensor TFLOP/s per device, by the parts of its name (upper case), first match wins:
NVIDIA's H200, H100 (SXM, PCIe, NVL), B200, A100, L40S, L40, L4 and V100 datasheets, AMD's MI300X and MI250X."""


def peak_tflops(device_name: str) -> float | None:
    """The `PEAK_TFLOPS` entry whose every part is in ``device_name`` (case-insensitive); None: not a known device."""
    upper = device_name.upper()
    return next((tflops for parts, tflops in PEAK_TFLOPS if all(p in upper for p in parts)), None)


def active_params(num_params: int, routed_params: int, num_experts: int, experts_per_token: int) -> int:
    """Parameters a token runs through: ``num_params - routed_params * (E - k) // E``; all where any is 0 (dense)."""
    if not routed_params or not num_experts or not experts_per_token:
        return num_params
    return num_params - routed_params * (num_experts - experts_per_token) // num_experts


def samples_per_s(exp: Experiment, objective: str) -> float | None:
    """``exp``'s own run's samples/s: its metric under ``throughput``, its distinct samples a step
    (`zerotune.model.zero_options.samples_per_step`) / its metric under ``latency`` (s/step); None otherwise or without
    a metric."""
    if exp.metric is None or exp.metric <= 0:
        return None
    if objective == "throughput":
        return exp.metric
    batch = samples_per_step(exp.ds_config, exp.num_nodes * exp.num_slots)
    return batch / exp.metric if objective == "latency" and batch else None


@dataclass(frozen=True)
class FlopsModel:
    """The model's FLOPs per token and the devices' peak, from the profile run (module docstring).

    Attributes:
        params: ``N``, the parameters a token runs through; layers, hidden: ``L`` and ``H`` (0: unknown).
        peak_flops: one device's peak, FLOP/s (None: unknown); peak_source: where it comes from (human text).
    """

    params: int
    layers: int = 0
    hidden: int = 0
    peak_flops: float | None = None
    peak_source: str = ""

    @classmethod
    def from_profile(cls, experiments: Iterable[Experiment], peak: float | None) -> "FlopsModel | None":
        """From the ok profile run's metrics among ``experiments`` (``num_params`` and the probe's
        `zerotune.probe.FLOPS_KEYS`, `zerotune.probe.DEVICE_NAME_KEY`) and ``--peak-tflops`` ``peak`` (None: by the
        device's name); None without a profile run."""
        profile = next((e for e in experiments if e.kind is ExperimentKind.PROFILE and e.status is Status.OK
                        and _count(e.metrics, "num_params")), None)
        if profile is None:
            return None
        m = profile.metrics
        params = active_params(_count(m, "num_params"), _count(m, "routed_params"), _count(m, "num_experts"),
                               _count(m, "experts_per_token"))
        name = m.get("device_name") if isinstance(m.get("device_name"), str) else ""
        known = peak_tflops(name) if name else None
        source = (f"--peak-tflops {peak:g}" if peak is not None else
                  f"{name}: {known:g} TFLOP/s dense 16-bit (datasheet)" if known is not None else "")
        tflops = peak if peak is not None else known
        return cls(params, _count(m, "num_layers"), _count(m, "hidden_size"),
                   None if tflops is None else tflops * 1e12, source)

    def flops_per_token(self, tokens_per_sample: float) -> float:
        """``6 * N + 12 * L * H * T``, FLOPs, ``T`` = ``tokens_per_sample`` (the module docstring)."""
        return 6 * self.params + 12 * self.layers * self.hidden * tokens_per_sample

    def mfu(self, exp: Experiment, objective: str) -> float | None:
        """``exp``'s MFU, 0..1: its tokens/s per device times `flops_per_token` over `peak_flops`; None without a
        peak, its tokens/s or its samples/s (`samples_per_s`)."""
        per_device, samples = tokens_per_device(exp), samples_per_s(exp, objective)
        if self.peak_flops is None or per_device is None or not samples or exp.tokens_per_s is None:
            return None
        return per_device * self.flops_per_token(exp.tokens_per_s / samples) / self.peak_flops

    def describe(self) -> str:
        """The summary's line: what the FLOPs count and the peak."""
        attention = (f" + 12 * {self.layers} layers * {self.hidden} hidden * tokens per sample" if self.layers
                     and self.hidden else " (the attention term left out: the model's layers and hidden size unknown)")
        peak = (f"against {self.peak_source}" if self.peak_flops is not None
                else "no peak known for this device: --peak-tflops gives it")
        return f"MFU: 6 * {self.params:,} params{attention} FLOPs per token, {peak}"


def tokens_per_device(exp: Experiment) -> float | None:
    """``exp``'s tokens/s over its devices (nodes times slots); None without its tokens/s."""
    devices = exp.num_nodes * exp.num_slots
    return None if exp.tokens_per_s is None or devices < 1 else exp.tokens_per_s / devices


def _count(metrics: Mapping[str, Any], key: str) -> int:
    value = metrics.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
