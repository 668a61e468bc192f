"""What the profile run measured: DeepSpeed's ``model_info.json`` as a `ModelInfo`.

DeepSpeed's engine writes ``model_info.json`` (``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu``)
and exits in the first forward when ``autotuning.model_info.profile`` is set; the experiment directory module reads
it into ``metrics`` with the probe's keys. The activation term per sample is the probe's saved bytes wherever they
are recorded (`SAVED_ACTIVATIONS_KEY`), not DeepSpeed's figure; on CUDA the larger with the step's growth less its
constant part (`step_activations`), on CPU with the growth per sample from wider micro steps (`SLOPE_KEY`,
`ModelInfo.from_metrics`). Checkpointing is priced where the profile ran without it (`CHECKPOINTED_ACTIVATIONS_KEY`).
Evidence: docs/decisions.md, D111, D204.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotune.deepspeed.config import precision

SAVED_ACTIVATIONS_KEY = "activation_saved_bytes"  # bytes per sample, from the probe (per sample already)
CHECKPOINTED_ACTIVATIONS_KEY = "activation_checkpointed_bytes"  # bytes per sample, from the probe (per sample)
STEP_GROWTH_KEY = "step_growth_bytes"  # bytes at the profile's mbs, from the probe (zerotune.probe.GROWTH_KEYS)
SLOPE_KEY = "slope_bytes"  # bytes per sample, from the probe on CPU (zerotune.probe.SLOPE_KEY)
DATA_SLOPE_KEY = "data_slope_bytes"  # bytes per sample of VmData, from the probe on CPU (zerotune.probe.SLOPE_KEYS)


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run measured.

    Attributes:
        num_params: parameters of the model over all model-parallel ranks.
        trainable_num_params: those with ``requires_grad``.
        activation_mem_per_gpu: activation bytes per device per sample: the probe's bytes saved for
            the backward pass (`SAVED_ACTIVATIONS_KEY`, with the largest recomputed region under
            activation checkpointing: `zerotune.probe.read_saved_activations`) when recorded, else
            DeepSpeed's change in device memory across the first forward pass at the profile's mbs (on CPU in resident
            memory, which in a ZeRO-3 profile run also holds the parameters that forward gathered), i.e. at mbs=1.
            On CUDA, where the record has the step's growth, the larger of the saved bytes and that growth less its
            constant part (`step_activations`).
        peak_memory_bytes: on CUDA the probe's ``device_peak_bytes`` (rank 0's device at the peak:
            the allocator's reserved high-water mark, the CUDA context, NCCL; the probe writes it only
            on CUDA), which wins over the backend's figure: the local backend samples the ranks' host
            ``VmData``, which is not the device's memory. On CPU the larger of the backend's sampled
            peak (every rank, every 0.2 s) and the probe's ``data_peak_bytes`` (rank 0's ``VmData``,
            every 5 ms: the first forward's peak can be shorter than the backend's period); else None.
        largest_layer_params: the most parameters one module holds, elements (the probe's; 0: unknown).
        persistent_params: parameters ZeRO-3 keeps gathered, elements (the probe's; 0: unknown, or a profile
            run below stage 3, which persists none: the job then tunes no stage that needs it).
        peak_after_backward: whether `peak_memory_bytes` was taken after the profile's first backward
            (on CPU where the probe ran it: the calibration then models that state,
            `zerotune.model.memory.MemoryModel.profile_step_bytes`).
        checkpointed_activation_mem_per_gpu: activation bytes per device per sample with activation checkpointing
            of every checkpointable layer (`CHECKPOINTED_ACTIVATIONS_KEY`), plus what the CUDA step's growth
            adds to `activation_mem_per_gpu` over the saved bytes (what the backward allocates on top, the
            gradient of the logits, is there with checkpointing too); None: not priced.
    """

    num_params: int
    trainable_num_params: int
    activation_mem_per_gpu: int
    peak_memory_bytes: int | None = None
    largest_layer_params: int = 0
    persistent_params: int = 0
    checkpointed_activation_mem_per_gpu: int | None = None
    peak_after_backward: bool = False

    @classmethod
    def from_metrics(cls, data: dict[str, Any], peak_memory_bytes: int | None = None, mbs: int = 1,
                     ds_config: dict[str, Any] | None = None) -> "ModelInfo":
        """From the content of DeepSpeed's ``model_info.json`` written by a run at micro batch size
        ``mbs`` (its ``activation_mem_per_gpu`` covers ``mbs`` samples; divided here).
        `SAVED_ACTIVATIONS_KEY`, per sample already, replaces it when present.

        On CPU (a record with ``data_peak_bytes``): with `SLOPE_KEY`, the term is the largest of the saved
        bytes, `SLOPE_KEY` and `DATA_SLOPE_KEY` (``VmData``'s, which the CPU budget limits). Where
        the probe ran the backward (`STEP_GROWTH_KEY`), the profile's peak is ``data_peak_bytes`` alone:
        rank 0's ``VmData`` after that backward and before the wider steps, which the backend's sampled peak also
        holds (`peak_after_backward`). Its `STEP_GROWTH_KEY` is never read as activations: at mbs 1
        the step holds the gradients and gathered parameters as much as activations.

        On CUDA, with
        `STEP_GROWTH_KEY`, the term is `step_activations` of the two, the profile's ``ds_config``
        giving its ZeRO stage and precision (None: an fp32 run below stage 3).
        `CHECKPOINTED_ACTIVATIONS_KEY` gives `checkpointed_activation_mem_per_gpu`.

        Raises:
            KeyError, ValueError: ``num_params`` is missing or a field is not a number.
        """
        activations = (max(0, int(data[SAVED_ACTIVATIONS_KEY])) if SAVED_ACTIVATIONS_KEY in data
                       else max(0, int(data.get("activation_mem_per_gpu", 0))) // mbs)
        if SLOPE_KEY in data:
            activations = max(activations, int(data[SLOPE_KEY]), int(data.get(DATA_SLOPE_KEY) or 0))
        elif SAVED_ACTIVATIONS_KEY in data and data.get(STEP_GROWTH_KEY) is not None and "data_peak_bytes" not in data:
            activations = step_activations(activations, int(data[STEP_GROWTH_KEY]), mbs, ds_config or {},
                                           int(data.get("trainable_num_params", data["num_params"])))
        checkpointed = None
        if data.get(CHECKPOINTED_ACTIVATIONS_KEY) is not None:
            on_top = activations - max(0, int(data[SAVED_ACTIVATIONS_KEY])) if SAVED_ACTIVATIONS_KEY in data else 0
            checkpointed = max(0, int(data[CHECKPOINTED_ACTIVATIONS_KEY])) + max(0, on_top)
        after_backward = (not data.get("device_peak_bytes") and STEP_GROWTH_KEY in data
                          and bool(data.get("data_peak_bytes")))
        return cls(num_params=int(data["num_params"]),
                   trainable_num_params=int(data.get("trainable_num_params", data["num_params"])),
                   activation_mem_per_gpu=activations,
                   peak_memory_bytes=(int(data["device_peak_bytes"]) if data.get("device_peak_bytes")
                                      else int(data["data_peak_bytes"]) if after_backward
                                      else max(peak_memory_bytes or 0, int(data.get("data_peak_bytes") or 0))
                                      or None),
                   largest_layer_params=max(0, int(data.get("largest_layer_params", 0))),
                   persistent_params=max(0, int(data.get("persistent_params", 0))),
                   checkpointed_activation_mem_per_gpu=checkpointed, peak_after_backward=after_backward)

    def to_metrics(self, mbs: int = 1) -> dict[str, int]:
        """The ``model_info.json`` content DeepSpeed would write for this model at micro batch size ``mbs``."""
        return {"num_params": self.num_params, "trainable_num_params": self.trainable_num_params,
                "activation_mem_per_gpu": self.activation_mem_per_gpu * mbs}


def step_activations(saved_per_sample: int, step_growth_bytes: int, mbs: int, ds_config: dict[str, Any],
                     trainable_params: int) -> int:
    """The activation term per sample on CUDA, bytes: ``max(saved, (step_growth - constant) / mbs)``.

    ``saved_per_sample`` is the probe's `SAVED_ACTIVATIONS_KEY`; ``step_growth_bytes`` its
    ``step_growth_bytes`` (the allocated high-water mark over the profile's forward and ``loss.backward()``
    less what was allocated before, at micro batch size ``mbs``). ``constant`` is what that growth holds
    whatever the mbs and the term should not: at ZeRO-3, nothing (the modules ZeRO-3 gathers are released
    before the step's peak, or were gathered before the baseline: on an H100 a GPT-2 profile's growth at mbs 1
    was 6% above the slope its runs measured at mbs 80-125, not the 25% a gathered embedding and its gradient
    would add; docs/decisions.md, D204); below stage 3, the gradients of every trainable parameter, which the
    backward allocates before any reduction, ``b * trainable_params`` (an over-count at stage 2, whose buckets
    hold fewer, and under model parallelism: the figure then falls back towards ``saved``, which the runs'
    own slopes raise, never the other way). ``b`` is the element size of the profile's precision
    (``zerotune.deepspeed.config.precision`` of ``ds_config``: 4 in fp32, else 2, as the memory model's). The
    constant is never more than the growth."""
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else 0
    b = 4 if precision(ds_config) == "fp32" else 2
    constant = 0 if stage == 3 else b * trainable_params
    grown = max(0, step_growth_bytes - constant) // max(1, mbs)
    return max(saved_per_sample, grown)
