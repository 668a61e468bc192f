"""What a tuning strategy learnt: the profile, the memory model, each ZeRO stage's decision, knob phases, ledger."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zerotune.core.experiment import Experiment
from zerotune.core.noise import RunNoise
from zerotune.model.online import OnlineMemory
from zerotune.model.profile import ModelInfo
from zerotune.strategy.ledger import Ledger
from zerotune.strategy.longest import LongestResult
from zerotune.strategy.points import MbsTrace
from zerotune.strategy.prediction import Prediction
from zerotune.strategy.stop_bound import StopBound


class StageDecision(str, enum.Enum):
    """How `explore_stages` handled a ZeRO stage."""

    EXPLORED = "explored"  # a full mbs search
    PROBED = "probed"  # one experiment (at its own largest mbs, or the best stage's), not better
    PRUNED = "pruned"  # the memory model: cannot fit at the smallest mbs, never launched
    NOT_LAUNCHED = "not launched"  # every probe refused: the fitted memory model predicts each over the budget
    SKIPPED = "skipped"  # no larger mbs than the best, and a lower stage already slower at equal mbs


@dataclass(frozen=True)
class Saver:
    """A memory saver on top of a ZeRO stage (`zerotune.strategy.savers`): its name (``"offload optimizer"``...) and
    the ds_config settings deep-merged over the stage's config (``{"gradient_checkpointing": True}``...)."""

    name: str
    settings: dict = field(hash=False, compare=False)


@dataclass
class StageResult:
    """How one ZeRO stage, or one stage with a memory `Saver`, was handled (`StageDecision`), why
    (human text), the memory model's largest fitting mbs, and what its search tried."""

    stage: int
    decision: StageDecision | None
    reason: str
    estimate: int = 0
    trace: MbsTrace = field(default_factory=MbsTrace)
    saver: Saver | None = None

    @property
    def settings(self) -> dict:
        """The ds_config settings over the stage's config: the saver's (empty without one)."""
        return self.saver.settings if self.saver is not None else {}

    @property
    def key(self) -> int | str:
        """The stage (an int) without a saver; ``"<stage>+<saver>"`` with one: what keys per-variant records."""
        return self.stage if self.saver is None else f"{self.stage}+{self.saver.name}"

    @property
    def label(self) -> str:
        """``ZeRO stage 3``, or ``ZeRO stage 3 + checkpointing``: for the log and the summary."""
        return f"ZeRO stage {self.stage}" + (f" + {self.saver.name}" if self.saver is not None else "")


@dataclass
class StagePlan:
    """What the memory model says of a stage: the largest fitting mbs (0 = does not fit)."""

    stage: int
    max_mbs_estimate: int


@dataclass
class KnobPhase:
    """One stage's knob phase: where it ran (ZeRO stage, mbs) and how many configs its space held and fit."""

    stage: int
    mbs: int
    configs: int
    fitting: int


@dataclass
class StrategyResult:
    """What the strategy learnt; ``ledger`` holds every distinct experiment evaluated, in the order asked.

    Attributes:
        model_info: the profile's measurements (None: unknown, e.g. a dry run without a profile).
        memory: the memory model built from it, fitted online to the runs' peaks (None: model size unknown).
        stages: one `StageResult` per candidate stage, ascending, then the savers' variants.
        predictions: the candidates the throughput model kept from launching, with their bounds and why.
        knob_phases, savers_notes: the knob phases run; what the savers phase did not try, and why.
        stopped: why the launch budget stopped the tuning, and the phases not decided ("" when it ran them all).
        stop_bound: with ``stopped``, what was left undecided and by how much the answer could be beaten.
        longest: the answer checked at the longest batch (`zerotune.strategy.longest`).
    """

    model_info: ModelInfo | None = None
    memory: OnlineMemory | None = None
    stages: list[StageResult] = field(default_factory=list)
    knob_phases: list[KnobPhase] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    predictions: list[Prediction] = field(default_factory=list)
    savers_notes: list[str] = field(default_factory=list)
    stopped: str = ""
    longest: LongestResult = field(default_factory=LongestResult)
    stop_bound: StopBound | None = None

    @property
    def experiments(self) -> list[Experiment]:
        """The ledger's experiments, in the order asked."""
        return self.ledger.experiments

    @property
    def run_noise(self) -> RunNoise:
        """The run-to-run noise of the runs so far (`Ledger.run_noise`)."""
        return self.ledger.run_noise

    @property
    def answer(self) -> Experiment | None:
        """The answer over the ledger (`Ledger.answer`): the optimal config; None before any ran ok."""
        return self.ledger.answer
