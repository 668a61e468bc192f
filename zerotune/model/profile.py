"""What the profile run measured: DeepSpeed's ``model_info.json`` as a `ModelInfo` (D111, D204).

DeepSpeed's engine writes ``model_info.json`` (``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu``)
and exits in the first forward when ``autotuning.model_info.profile`` is set; the experiment directory module reads
it into ``metrics`` with the probe's keys. The activation term per sample is the probe's saved bytes wherever they
are recorded (`SAVED_ACTIVATIONS_KEY`), not DeepSpeed's figure; on CUDA the larger with the step's growth less its
constant part (`step_activations`), on CPU with the growth per sample from wider micro steps (`SLOPE_KEY`,
`ModelInfo.from_metrics`). Checkpointing is priced where the profile ran without it (`CHECKPOINTED_ACTIVATIONS_KEY`).
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
        num_params, trainable_num_params: parameters over all model-parallel ranks, and those with ``requires_grad``.
        activation_mem_per_gpu: activation bytes per device per sample (`from_metrics`): the probe's bytes saved
            for the backward (`SAVED_ACTIVATIONS_KEY`, with the largest recomputed region under checkpointing) when
            recorded, else DeepSpeed's change in device memory across the first forward (on CPU in resident memory,
            which at ZeRO-3 also holds the parameters that forward gathered).
        peak_memory_bytes: on CUDA the probe's ``device_peak_bytes`` (rank 0's device at its peak), not the
            backend's figure (the ranks' host ``VmData``); on CPU the larger of the backend's sampled peak and the
            probe's ``data_peak_bytes`` (rank 0's ``VmData`` every 5 ms, D202); else None.
        largest_layer_params: the most parameters one module holds, elements (0: unknown).
        persistent_params: parameters ZeRO-3 keeps gathered, elements (0: unknown, or a profile run below stage 3).
        peak_after_backward: whether `peak_memory_bytes` was taken after the profile's first backward (on CPU where
            the probe ran it; the calibration then uses `zerotune.model.memory.MemoryModel.profile_step_bytes`).
        checkpointed_activation_mem_per_gpu: the same with every checkpointable layer checkpointed
            (`CHECKPOINTED_ACTIVATIONS_KEY`), plus what the CUDA step's growth adds over the saved bytes (the
            logits' gradient is there with checkpointing too); None: not priced.
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
        """From DeepSpeed's ``model_info.json`` content with the probe's keys, written at micro batch size ``mbs``.

        The activation term is `SAVED_ACTIVATIONS_KEY` (per sample) when present, else DeepSpeed's figure over
        ``mbs``. On CPU (a record with ``data_peak_bytes``) with `SLOPE_KEY`: the largest of it, `SLOPE_KEY` and
        `DATA_SLOPE_KEY` (``VmData``'s, which the CPU budget limits); `STEP_GROWTH_KEY` is never read as activations
        there (at mbs 1 it holds the gradients and gathered parameters as much), and where present the peak is
        ``data_peak_bytes`` alone (rank 0 after that backward, `peak_after_backward`). On CUDA with
        `STEP_GROWTH_KEY`: `step_activations`, ``ds_config`` giving the profile's stage and precision (None: fp32
        below stage 3). `CHECKPOINTED_ACTIVATIONS_KEY` gives `checkpointed_activation_mem_per_gpu`.

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
    """The activation term per sample on CUDA, bytes: ``max(saved, (step_growth - constant) / mbs)`` (D204).

    ``saved_per_sample`` is the probe's `SAVED_ACTIVATIONS_KEY`; ``step_growth_bytes`` the allocated high-water mark
    over the profile's forward and ``loss.backward()`` less what was allocated before, at ``mbs``. ``constant`` is
    what that growth holds whatever the mbs: nothing at ZeRO-3 (its gathered modules are released before the peak,
    or gathered before the baseline); below stage 3 every trainable parameter's gradient, ``b * trainable_params``,
    ``b`` the profile precision's element size (4 in fp32, else 2): an over-count at stage 2 and under model
    parallelism, which falls back towards ``saved``. The constant is never more than the growth."""
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else 0
    b = 4 if precision(ds_config) == "fp32" else 2
    constant = 0 if stage == 3 else b * trainable_params
    grown = max(0, step_growth_bytes - constant) // max(1, mbs)
    return max(saved_per_sample, grown)
