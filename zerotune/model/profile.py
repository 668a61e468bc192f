"""What the profile run measured: DeepSpeed's ``model_info.json`` as a :class:`ModelInfo`.

DeepSpeed's engine writes ``model_info.json`` (``num_params``, ``trainable_num_params``,
``activation_mem_per_gpu``) and exits in the first forward pass when the config's
``autotuning.model_info.profile`` is set (``engine._get_model_parameters`` and ``forward``). The
profile run's config comes from :meth:`zerotune.strategy.configs.ConfigBuilder.profile`; the
experiment directory module reads the file into the experiment's ``metrics``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run measured.

    Attributes:
        num_params: parameters of the model over all model-parallel ranks.
        trainable_num_params: those with ``requires_grad``.
        activation_mem_per_gpu: activation bytes per device per sample (DeepSpeed measures the
            change in device memory across the first forward pass at the profile's mbs; on CPU in
            resident memory), i.e. at mbs=1.
        peak_memory_bytes: peak bytes per rank the backend saw during the run, when it can
            see it (CPU), else None.
    """

    num_params: int
    trainable_num_params: int
    activation_mem_per_gpu: int
    peak_memory_bytes: int | None = None

    @classmethod
    def from_metrics(cls, data: dict[str, Any], peak_memory_bytes: int | None = None, mbs: int = 1) -> "ModelInfo":
        """From the content of DeepSpeed's ``model_info.json`` written by a run at micro batch size
        ``mbs`` (its ``activation_mem_per_gpu`` covers ``mbs`` samples; divided here).

        Raises:
            KeyError, ValueError: ``num_params`` is missing or a field is not a number.
        """
        return cls(num_params=int(data["num_params"]),
                   trainable_num_params=int(data.get("trainable_num_params", data["num_params"])),
                   activation_mem_per_gpu=max(0, int(data.get("activation_mem_per_gpu", 0))) // mbs,
                   peak_memory_bytes=peak_memory_bytes)

    def to_metrics(self, mbs: int = 1) -> dict[str, int]:
        """The ``model_info.json`` content DeepSpeed would write for this model at micro batch size ``mbs``."""
        return {"num_params": self.num_params, "trainable_num_params": self.trainable_num_params,
                "activation_mem_per_gpu": self.activation_mem_per_gpu * mbs}
