"""SIMULATED experiments behind zerotune's ``Backend`` interface: no process is launched.

``SimulatedBackend.run`` does what ``LocalBackend.run`` does around a real launch, with the
launch replaced by :meth:`Simulator.run`: :func:`zerotune.run.expdir.prepare` writes the
experiment's ``ds_config.json`` (with the ``autotuning`` section a real run gets); this backend
writes a ``cmd.txt`` saying SIMULATED, ``stdout.log`` and ``stderr.log`` (a CUDA OOM traceback line
when the config does not fit), and the file DeepSpeed's engine would write: ``model_info.json``
for the profile run (``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu``, as
``engine.forward`` writes it, with zerotune's probe's ``activations.json`` beside it) or
``metrics.json`` (``latency`` in microseconds, ``throughput`` in samples/s, ``FLOPS_per_gpu``, as
``engine._autotuning_exit`` writes it). The outcome is then read and classified from those files by
zerotune's own :func:`zerotune.run.expdir.finish`, exactly as for a real run, and ``wall_s`` is
the SIMULATED duration (nothing sleeps). The scheduler writes ``exp.json``.

Adaptive experiments are simulated as the local backend runs them: with a stop rule, the probe
streams are offered to :meth:`zerotune.core.stopping.StopRule.check` one step at a time, as a real
run's grow; where it answers, the run ends there (its streams cut after that step, no
``metrics.json``, the duration up to that step) and ``finish`` is told why.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from benchmarks.simcluster.model import Outcome, Simulator, ZeroSettings
from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.core.launch import Reservation
from zerotune.core.objective import Objective
from zerotune.core.stopping import EndReason, StopRule, extended_end_step
from zerotune.probe import ACTIVATIONS_RECORD, step_records, stream_name
from zerotune.run import expdir
from zerotune.run.backends.base import Backend
from zerotune.run.store import write_json_atomic

OOM_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {alloc:.2f} GiB. GPU 0 has a total "
            "capacity of {cap:.2f} GiB (SIMULATED)")


@dataclass(frozen=True)
class LedgerEntry:
    """One SIMULATED launch: what ran, how long, on how many GPUs."""

    name: str
    ds_config: dict
    status: str
    duration_s: float
    num_gpus: int
    profile: bool

    @property
    def gpu_hours(self) -> float:
        return self.duration_s * self.num_gpus / 3600


def oom_stderr(outcome: Outcome, memory_bytes: int) -> str:
    """The stderr of a SIMULATED CUDA OOM (the allocator's own message, as a real run prints it)."""
    over = max(outcome.memory.total - memory_bytes, 1)
    where = "during engine initialization" if outcome.oom_phase == "init" else "in the first training step"
    return (f"[SIMULATED] rank 0: out of device memory {where}\n"
            "Traceback (most recent call last):\n"
            + OOM_LINE.format(alloc=over / 2**30, cap=memory_bytes / 2**30) + "\n")


class SimulatedBackend(Backend):
    """Runs zerotune's experiments on a :class:`Simulator` (SIMULATED cluster, no process).

    Args:
        sim: the workload and cluster.
        metric: the metric zerotune tunes (``throughput``, ``latency``, ``flops``).
        start_profile_step, end_profile_step: written into each config's ``autotuning`` section,
            as the local backend does.
        stop_rule: ends runs early, as the local backend does with the job's stop rule (None:
            every run goes to ``end_profile_step``).

    Every launch is appended to :attr:`ledger` (thread-safe).
    """

    def __init__(self, sim: Simulator, metric: str = "throughput", start_profile_step: int = 3,
                 end_profile_step: int = 5, stop_rule: StopRule | None = None):
        self.sim = sim
        self.objective = Objective.named(metric)
        self.stop_rule = stop_rule
        self.start_profile_step = start_profile_step
        self.end_profile_step = end_profile_step
        self.ledger: list[LedgerEntry] = []
        self._lock = threading.Lock()

    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        exp_dir = Path(exp_dir)
        profile = exp.kind is ExperimentKind.PROFILE
        adaptive = self.stop_rule is not None and not profile
        end_step = extended_end_step(self.end_profile_step) if adaptive else self.end_profile_step
        expdir.prepare(exp, exp_dir, self.objective, self.start_profile_step, end_step)
        (exp_dir / expdir.CMD_FILE).write_text(f"# SIMULATED: no process launched; {reservation.world_size} GPUs "
                                               f"({reservation.include_arg()[:80]}...)\n")

        extra = end_step - self.end_profile_step
        outcome = self.sim.run(exp.ds_config, profile=profile, extra_steps=extra)
        streams, duration, ended = outcome.streams or {}, outcome.duration_s, None
        if streams and adaptive:
            streams, duration, ended = self._adaptive(exp, outcome)
        memory_bytes = self.sim.cluster.device.memory_bytes
        stderr = "" if outcome.ok else oom_stderr(outcome, memory_bytes)
        (exp_dir / expdir.STDERR_LOG).write_text(stderr)
        (exp_dir / expdir.STDOUT_LOG).write_text(f"[SIMULATED] {outcome.status} after {duration:.1f} s\n")
        if outcome.ok and ended is None:  # what DeepSpeed's engine would write: model_info.json or metrics.json
            sp = ZeroSettings.from_config(exp.ds_config).sp
            result = self.sim.model_info(exp.mbs, sp) if profile else self.sim.metrics(outcome)
            write_json_atomic(expdir.result_path(exp, exp_dir), result)
            if profile:  # what zerotune's probe would write in the profile run
                write_json_atomic(exp_dir / ACTIVATIONS_RECORD, self.sim.probe_activations(exp.mbs, sp))
        for rank, records in streams.items():  # what zerotune's step probe would write
            (exp_dir / stream_name(rank)).write_text("".join(json.dumps(r) + "\n" for r in records))

        expdir.finish(exp, exp_dir, self.objective, exit_code=0 if outcome.ok else 1, ended=ended)
        exp.wall_s = round(duration, 3)
        with self._lock:
            self.ledger.append(LedgerEntry(exp.name, exp.ds_config, outcome.status, duration,
                                           reservation.world_size, profile))
        return exp

    def _adaptive(self, exp: Experiment, outcome: Outcome) -> tuple[dict[int, list[dict]], float, EndReason | None]:
        """Offer the run's streams to the stop rule one step at a time: (streams up to where it
        ended, its SIMULATED duration, why) or the whole run when the rule never answers."""
        full = outcome.streams
        typed = step_records(full)  # each line validated once, as read_streams does for a real run's files
        steps = min(len(records) for records in full.values())
        for k in range(1, steps + 1):
            prefix = {rank: records[:k] for rank, records in full.items()}
            ended = self.stop_rule.check({rank: records[:k] for rank, records in typed.items()}, exp.must_beat,
                                         self.end_profile_step + 1, self.sim.startup_s())
            if ended is not None:
                elapsed = max(records[k - 1]["t"] for records in full.values())
                return prefix, self.sim.startup_s() + elapsed, ended
        return full, outcome.duration_s, None
