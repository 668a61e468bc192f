"""What a running experiment's files say while it runs: when it last made progress (`RunProgress`, for the
hang timeout) and whether its stop rule can end it (`StreamWatch`, adaptive experiments). Both read the probe's
streams and the logs as they grow (`zerotune.probe`); the backends act on the answers."""
from __future__ import annotations

from pathlib import Path

from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.core.step_record import StepRecord
from zerotune.core.stopping import EndReason, StopRule, extended_end_step
from zerotune.probe import read_streams, run_phases, stream_files
from zerotune.run import expdir

__all__ = ["RunProgress", "StreamWatch"]


class RunProgress:
    """When a run last made progress: its probe streams grew, or, before its first step, its logs grew (after it,
    output alone is no progress: a hung collective's heartbeat is not a step)."""

    def __init__(self, exp_dir: Path, start: float):
        self.exp_dir, self.last_change = exp_dir, start
        self._steps, self._output = 0, -1

    @property
    def stepped(self) -> bool:
        """Whether the run has recorded a step."""
        return self._steps > 0

    def idle_s(self, now: float) -> float:
        """Seconds since the last progress, at ``now`` (``time.monotonic()``)."""
        steps = sum(expdir.file_size(path) for path in stream_files(self.exp_dir).values())
        if steps != self._steps:
            self._steps, self.last_change = steps, now
        elif not steps:
            output = expdir.output_bytes(self.exp_dir)
            if output != self._output:
                self._output, self.last_change = output, now
        return now - self.last_change


class StreamWatch:
    """Reads an experiment's probe streams while it runs (only when a file grew) and asks the stop rule whether it
    can end (`zerotune.core.stopping`). The profile run and a run at the longest batch (``pad_seq_len``) are read for
    their memory, not timed: never watched, so never extended past ``end_profile_step``. Another run is launched with
    an extended engine exit: the rule ends it at ``end_profile_step`` unless more steps pay within its start-up
    time, from ``launched_at`` (``time.monotonic()``, the probe's clock) to its first step."""


    def __init__(self, exp_dir: Path, rule: StopRule | None, exp: Experiment, end_profile_step: int):
        self.exp_dir, self.exp = exp_dir, exp
        self.rule = None if exp.kind is ExperimentKind.PROFILE or exp.pad_seq_len else rule
        self.cap_step = end_profile_step + 1  # DeepSpeed's exiting step is recorded too
        self.end_step = extended_end_step(end_profile_step) if self.rule is not None else end_profile_step
        """The ``end_profile_step`` the run's config is written with: the engine's own exit."""
        self.launched_at: float | None = None
        self._sizes: dict[int, int] = {}
        self._streams: dict[int, list[StepRecord]] = {}

    def check(self) -> EndReason | None:
        if self.rule is None:
            return None
        sizes = {rank: expdir.file_size(path) for rank, path in stream_files(self.exp_dir).items()}
        if sizes == self._sizes:
            return None
        self._sizes = sizes
        self._streams = read_streams(self.exp_dir)
        return self.rule.check(self._streams, self.exp.must_beat, self.cap_step, self.startup_s())

    def startup_s(self) -> float | None:
        """Seconds from the launch to the start of the first step (None: not known yet)."""
        return run_phases(self._streams, self.launched_at)[0]

    def reached_cap(self) -> bool:
        """Whether every rank recorded ``end_profile_step``'s exiting step (read afresh)."""
        return self.rule is not None and self._reached(self.cap_step)

    def script_ended(self) -> bool:
        """Whether a run that exited on its own past the cap stopped at its script's last step (`EndReason.SCRIPT_END`,
        D323), before the engine's extended exit, rather than at that exit (read afresh)."""
        return self.reached_cap() and not self._reached(self.end_step + 1)

    def _reached(self, step: int) -> bool:
        streams = read_streams(self.exp_dir)
        return bool(streams) and all(any(r.step is not None and r.step >= step for r in records)
                                     for records in streams.values())
