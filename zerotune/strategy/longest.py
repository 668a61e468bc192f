"""The answer at the longest batch: a config that fits the batches the tuning saw but not the longest the training
can meet is not the answer; the next one that fits is (D309).

After every other phase, `settle_longest` checks the answer's predicted peak at the longest batch
(`zerotune.model.tokens`); one over the budget is excluded from the answer rule and the next is checked, until one fits
or none is left (then the last stands, said so). ``--verify-longest`` runs the answer once with every batch padded to
that length: not a candidate, it teaches the memory fit nothing, and one out of memory excludes its config. A workload
without token ids (no length recorded) or of one fixed length is left as it is.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes
from zerotune.inputs.options import LongestOptions
from zerotune.model.tokens import LongestBatch, LongestCheck, check_longest, longest_batch
from zerotune.model.zero_options import ZeroOptions

__all__ = ["LongestResult", "VERIFY_SPACE", "settle_longest"]

logger = logging.getLogger(__name__)

VERIFY_SPACE = "longest"
"""The tuning space of a verification run (``<answer>_longest<L>``), for the summary."""
MAX_VERIFICATIONS = 3
"""Verification runs at most: each one that runs out of memory moves the answer to the next config."""


@dataclass
class LongestResult:
    """What the check found: the longest batch (None: no length known), every config checked in order (the last
    is the answer's), and the verification runs."""

    batch: LongestBatch | None = None
    checks: list[LongestCheck] = field(default_factory=list)
    verified: list[Experiment] = field(default_factory=list)
    not_verified: str = ""  # with --verify-longest, why no run was made ('' when one was, or none was asked)

    def notes(self) -> list[str]:
        """The summary's lines: the longest batch, each check and verification, or why ``--verify-longest`` ran none."""
        if self.not_verified:
            return [f"--verify-longest: nothing run: {self.not_verified}"]
        if self.batch is None or self.batch.fixed:
            return []
        seen = f"; the runs saw at most {self.batch.seen}" if self.batch.seen else ""
        lines = [f"longest batch: {self.batch.seq_len} tokens ({self.batch.source}{seen})"]
        for i, check in enumerate(self.checks):  # every check but the last excluded its config
            last = i == len(self.checks) - 1
            verdict = ("the answer" if check.fits else "the answer still, though over the budget at the longest "
                       "batch: no other config that ran is left") if last else \
                "not the answer: over the budget at the longest batch"
            lines.append(f"longest batch: {check.describe()}: {verdict}")
        predicted = {c.name: c.predicted_bytes for c in self.checks}
        for run in self.verified:
            lines.append(f"verified at the longest batch: {run.name} (every batch padded to {run.pad_seq_len} "
                         f"tokens): {_outcome(run, predicted.get(run.name.rsplit('_longest', 1)[0]))}")
        return lines


def _outcome(run: Experiment, predicted: int | None) -> str:
    """``ran, peak 2.84 GiB (predicted 2.38 GiB: -16%)``, or how it ended and why."""
    if run.status is Status.OK and run.peak_memory_bytes:
        error = "" if not predicted else (f" (predicted {format_bytes(predicted)}: "
                                          f"{predicted / run.peak_memory_bytes - 1:+.0%})")
        return f"ran, peak {format_bytes(run.peak_memory_bytes)}{error}"
    why = run.error.strip().lstrip(":").strip()[:200]
    return (run.status.value if run.status else "did not run") + (f" ({why})" if why else "")


def settle_longest(ev, options: LongestOptions, max_positions: int | None, square: float = 0.0) -> LongestResult:
    """Check the answer at the longest batch, excluding each that fails (`zerotune.strategy.ledger.Ledger.exclude`)
    while another is left; with ``options.verify`` also run it, at most `MAX_VERIFICATIONS` times, every micro batch
    padded (`zerotune.core.experiment.Experiment.pad_seq_len`). ``ev``: the strategy's Evaluator; ``max_positions``:
    the model's (None: unknown); ``square``: its attention scores' bytes per token squared per sample
    (`zerotune.model.tokens.square_bytes`)."""
    result, ledger, budget = LongestResult(), ev.ledger, ev.job.device_memory_bytes
    memory = ev.result.memory
    runs = [e for e in ledger.experiments if e.kind is not ExperimentKind.PROFILE]
    result.batch = longest_batch(options.max_seq_len, max_positions, runs)
    if result.batch is None or result.batch.fixed or result.batch.seen is None or memory is None or not budget:
        if options.verify:  # no token ids seen (images, the memory oracle), or one length: nothing to check
            result.not_verified = _why_not(result.batch, memory is not None and bool(budget))
        return result
    while (answer := ledger.answer) is not None:
        check = check_longest(answer, memory, runs, result.batch, budget, square)
        if check is not None:
            result.checks.append(check)
            logger.info(f"longest batch: {check.describe()}")
        if check is not None and not check.fits and _others(ledger, answer):
            ledger.exclude(answer.name, f"predicted {format_bytes(check.predicted_bytes)} at the longest batch "
                                        f"({check.longest} tokens), over the {format_bytes(budget)} budget")
            continue
        if not options.verify or len(result.verified) >= MAX_VERIFICATIONS:
            break
        run = _verify(ev, answer, result.batch.seq_len)
        result.verified.append(run)
        if run.status is Status.OK or not run.status or not run.status.over_budget or not _others(ledger, answer):
            break
        ledger.exclude(answer.name, f"ran out of memory with every batch padded to {result.batch.seq_len} tokens")
    return result


def _why_not(batch: LongestBatch | None, checkable: bool) -> str:
    """Why ``--verify-longest`` has nothing to run: no length seen, one length, or nothing to check against."""
    if batch is None or batch.seen is None:
        return ("the runs recorded no sequence length (no token ids in the script's batches): the longest batch is "
                "not known")
    if batch.fixed:
        return f"every batch the runs saw has one length ({batch.seq_len} tokens): the runs measured the longest"
    return "no memory model or budget to check the answer against" if not checkable else ""


def _others(ledger, answer: Experiment) -> bool:
    """Whether another config ran ok that the answer rule may take instead."""
    return any(e.status is Status.OK and e.replica_of is None and e.name != answer.name and e.name not in
               ledger.excluded and e.kind is not ExperimentKind.PROFILE for e in ledger.experiments)


def _verify(ev, answer: Experiment, seq_len: int) -> Experiment:
    """One run of the answer's config with every batch padded to ``seq_len`` tokens (a Ulysses rank's to its share),
    outside the ledger (not a candidate; its peak is not of the family's line in mbs)."""
    shard = seq_len // ZeroOptions.of(answer.ds_config).sp  # a Ulysses rank's share of each sequence
    exp = dataclasses.replace(ev.builder.experiment(answer.ds_config, answer.kind, answer.knobs),
                              name=f"{answer.name}_longest{seq_len}", space=VERIFY_SPACE, pad_seq_len=shard)
    (done,) = ev.launch_outside_ledger([exp])
    logger.info(f"verified at the longest batch: {done.name}: {done.status.value if done.status else '-'}")
    return done
