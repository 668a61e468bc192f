"""zerotune's own options for a tuning (`TuneOptions`), beyond the ds_config's ``autotuning`` section: what the
CLI's options and the Python API give `zerotune.inputs.job.Job.build`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerotune.core.noise import DEFAULT_PRECISION

__all__ = ["LongestOptions", "TuneOptions"]


@dataclass(frozen=True)
class LongestOptions:
    """``--max-seq-len N`` (the longest batch, tokens; None: from the model or the runs) and ``--verify-longest``
    (run the answer once at that length)."""

    max_seq_len: int | None = None
    verify: bool = False


@dataclass
class TuneOptions:
    """zerotune's own options, beyond the ds_config's ``autotuning`` section; the CLI's fill them by name (D328).

    Attributes:
        device_memory_bytes: per-device budget, bytes (required on CPU; None on CUDA: the device's memory).
        results_dir: overrides ``autotuning.results_dir``; experiments then go to ``<dir>/exps``.
        timeout_s, hang_timeout_s: per-experiment wall-clock limit and no-output limit, seconds.
        warm: fork ranks from a preloaded server (`zerotune.run.warm`); False: ``--cold-launch``.
        overwrite: overrides ``autotuning.overwrite`` (False: resume from results on disk).
        hostfile: the launcher's hostfile, for multi-node experiments.
        cpu: run DeepSpeed on CPU; None: on CPU when CUDA is not available.
        backend: ``local`` (a subprocess), ``ray`` (at ``ray_address``; None: ``$RAY_ADDRESS`` or a local cluster) or
            ``slurm`` (srun).
        variables: ``--var`` candidates, over ``autotuning.variables`` (`zerotune.inputs.variables`).
        precision: an adaptive run ends once its metric's 95% interval is within this relative half-width (0.02 =
            ±2%; `zerotune.core.stopping`).
        adaptive: end runs early (precise, or cannot beat the best); False: every run goes to ``end_profile_step``.
        host_memory_bytes: host memory per node, bytes, that offload must fit in with CUDA devices (``--host-memory``);
            None: this machine's when every node is it (local backend), else not checked. On CPU ranks offload stays
            in the rank's own budget.
        savers: try checkpointing and offload where memory binds a stage (`zerotune.strategy.savers`; False:
            ``--no-savers``); ``nvme_path`` (``--nvme-path``), a directory on local NVMe, lets them offload there too.
        train_samples, train_steps, cost_per_device_hour: the full training the report projects with the answer (its
            length; a device-hour's price); None: no projection (`zerotune.report.data.TrainingPlan`).
        peak_tflops: one device's peak TFLOP/s for MFU (``--peak-tflops``); None: by its name (`zerotune.model.flops`).
        max_launches, max_device_hours: what the tuning may spend (`zerotune.inputs.budget.LaunchBudget`).
        longest: ``--max-seq-len`` and ``--verify-longest`` (`LongestOptions`).
        master_port: the answer's rendezvous port (``cmd_optimal.txt``), the user's ``--master_port``; None:
            DeepSpeed's default, 29500. Each experiment takes a free port of its own.
    """

    device_memory_bytes: int | None = None
    results_dir: str | None = None
    timeout_s: float | None = None
    hang_timeout_s: float | None = None
    warm: bool = True
    overwrite: bool | None = None
    hostfile: str | None = None
    cpu: bool | None = None
    backend: str = "local"
    ray_address: str | None = None
    variables: dict[str, Any] = field(default_factory=dict)
    precision: float = DEFAULT_PRECISION
    adaptive: bool = True
    host_memory_bytes: int | None = None
    savers: bool = True
    nvme_path: str | None = None
    train_samples: int | None = None
    train_steps: int | None = None
    cost_per_device_hour: float | None = None
    peak_tflops: float | None = None
    max_launches: int | None = None
    max_device_hours: float | None = None
    longest: LongestOptions = LongestOptions()
    master_port: int | None = None
