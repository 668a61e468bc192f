"""The experiment, the unit of record: a name, a complete ds_config, a resource request and, once run, its outcome.

Each lives in its own directory under the results dir (``ds_config.json``, ``cmd.txt``, ``stdout.log``,
``stderr.log``, ``metrics.json``, ``exp.json``).
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Outcome of an experiment. Only ``OK`` carries a metric; the others are never scored."""

    OK = "ok"
    OOM = "oom"  # the allocator ran out of device memory (or the per-rank budget on CPU)
    FAILED = "failed"  # non-zero exit or no metrics, for a reason other than memory
    TIMEOUT = "timeout"  # killed after the per-experiment timeout or a hang
    INTERRUPTED = "interrupted"  # the tuner stopped while it ran; re-run on resume
    SKIPPED = "skipped"  # not launched: the throughput model says it cannot beat the best (never on disk)
    REFUSED = "refused"  # not launched: the memory model predicts it over the per-device budget (never on disk)

    @property
    def reusable(self) -> bool:
        """True when a rerun with the same resume key (`zerotune.run.resume`) reuses this outcome: OK, and OOM
        (the budget is in the key); the other failures may come from the moment (a port clash) and are re-run."""
        return self in (Status.OK, Status.OOM)

    @property
    def over_budget(self) -> bool:
        """Out of memory, measured (``OOM``) or predicted (``REFUSED``): what the searches cap an mbs below."""
        return self in (Status.OOM, Status.REFUSED)


LAUNCH_WARM = "warm"  # Experiment.launch: ranks forked from a preloaded server (zerotune.run.warm)
LAUNCH_COLD = "cold"  # Experiment.launch: ranks started by DeepSpeed's launcher (or srun, or Ray's actor)


class ExperimentKind(str, enum.Enum):
    """Why an experiment runs: which phase of the strategy asked for it."""

    PROFILE = "profile"  # the one launch that measures the model (DeepSpeed's model_info.json)
    MBS = "mbs"  # the micro-batch search of a ZeRO stage (and the stage probes)
    GAS = "gas"  # gradient accumulation steps tried at the best mbs (where the batch semantics allow)
    KNOBS = "knobs"  # the knob phase (``"fast": false``): a stage's tuning space at its best mbs


@dataclass
class Experiment:
    """One configuration to run.

    Attributes:
        name: canonical, unique name (also the directory name), e.g. ``z1_gas1_tmbspg8``.
        ds_config: the complete DeepSpeed config to launch (without zerotune's own paths).
        num_nodes, num_slots: nodes and device slots (ranks) per node requested.
        kind: the phase that asked for it; space: its tuning space (``z1``, ``z1_knobs``, ``profile``).
        knobs: dotted key -> value of the settings that vary in its tuning space (knob phase).
        status/metric/metrics/exit_code/wall_s/error: filled in after it ran; ``metric`` is the step probe's
            (`zerotune.core.measure`) where it measured the run, else from DeepSpeed's ``metrics.json``.
        must_beat, ended: the adaptive bar the strategy set (the incumbent's pessimistic bound, in the
            objective's unit; None: none) and why the run ended (`zerotune.core.stopping.EndReason`).
    """

    name: str
    ds_config: dict[str, Any]
    num_nodes: int = 1
    num_slots: int = 1
    kind: ExperimentKind = ExperimentKind.MBS
    space: str = ""
    knobs: dict[str, Any] = field(default_factory=dict)
    status: Status | None = None
    metric: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    wall_s: float | None = None
    error: str = ""
    memory_bytes: int | None = None  # the memory model's prediction per device, bytes (memory_rel_error compares)
    peak_memory_bytes: int | None = None  # measured peak per rank where the backend can see it
    metric_source: str = ""  # "probe" (zerotune's step probe) or "deepspeed" (metrics.json); "" without a metric
    metric_rel_half_width: float | None = None  # of the metric's 95% confidence interval (probe only), 0.02 = ±2%
    replica_of: str | None = None  # a re-measurement of this experiment (same config), pooled with it
    must_beat: float | None = None  # the bar set by the strategy: ended early once its interval is below it
    ended: str = ""  # why its run ended (zerotune.core.stopping.EndReason value); "" before it ran
    boundary_share: float | None = None  # share of its step in once-per-optimizer-step work (probe only), 0..1
    steady_steps: int | None = None  # the steps its metric is measured over, warm-up left out (probe only)
    bought_by: str = ""  # the strategy's rule that launched it ("gas: a re-measurement"); "" for the profile
    activation_slope_bytes: int | None = None  # CUDA: its own step's growth per sample, bytes (measure)
    max_seq_len_seen: int | None = None  # the longest sequence a micro batch of its run held from step 2 on, tokens
    #                                      (step 1's without a later step; probe only; under Ulysses the whole
    #                                      sequence, its shard times the degree): what its peak pairs with
    min_seq_len_seen: int | None = None  # the shortest step's longest sequence, tokens (probe only): lengths vary
    pad_seq_len: int | None = None  # every micro batch's token ids padded to this length, tokens (--verify-longest)
    started_at: float | None = None  # when the scheduler launched it, seconds since the epoch (the report's timeline)
    launch: str = ""  # how its ranks started: LAUNCH_WARM (forked from a warm server) or LAUNCH_COLD; "" not launched
    launch_note: str = ""  # why a run of a warm tuning went cold ("" when it did not)
    startup_s: float | None = None  # from the launch to the start of its first step, seconds (probe only)
    measure_s: float | None = None  # from the start of its first step to the end of its last, seconds (probe only)
    tokens_per_s: float | None = None  # tokens all its ranks' forwards held per second, steady steps (probe only)

    @property
    def stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def memory_rel_error(self) -> float | None:
        """The memory model's error, ``memory_bytes / peak_memory_bytes - 1`` (0.05: 5% over); None without both.
        On CPU the peak is the probe's largest ``VmData``, what ``RLIMIT_DATA`` limits (D202)."""
        if not self.memory_bytes or not self.peak_memory_bytes:
            return None
        return self.memory_bytes / self.peak_memory_bytes - 1

    @property
    def mbs(self) -> int:
        return int(self.ds_config["train_micro_batch_size_per_gpu"])

    @property
    def gas(self) -> int:
        return int(self.ds_config.get("gradient_accumulation_steps", 1))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value if self.status else None
        d["kind"] = self.kind.value
        err = self.memory_rel_error
        d["memory_rel_error"] = None if err is None else round(err, 4)  # derived, for readers of exp.json
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Experiment":
        d = dict(d)
        d["status"] = Status(d["status"]) if d.get("status") else None
        d["kind"] = ExperimentKind(d.get("kind", ExperimentKind.MBS.value))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

