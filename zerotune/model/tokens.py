"""Memory per token: the longest batch a training can meet, and a config's predicted peak there (D308, D309).

Rules: a tuning's runs see a few batches, training meets its longest (`longest_batch`), so a config's measured peak
is moved to that length (`check_longest`) by its family's bytes per token per sample (`token_slope`) and, where the
attention kernel keeps a tokens x tokens matrix, by bytes per token squared (`square_bytes`). A run's length is its
longest batch from step 2 on (`zerotune.core.experiment.Experiment.max_seq_len_seen`): step 1 lacks the optimizer
states, so a longer batch there alone is left out, a safe error. A fixed-shape workload (every batch of every run one
length) predicts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes
from zerotune.model.linefit import fit_line
from zerotune.model.online import OnlineMemory, family

__all__ = ["LongestBatch", "LongestCheck", "check_longest", "longest_batch", "square_bytes", "token_slope"]


@dataclass(frozen=True)
class LongestBatch:
    """The longest batch the training can meet: ``seq_len`` tokens per sample, ``source`` where that comes from (as
    the summary says it), ``seen`` the longest a run held from step 2 on (None: none recorded), ``fixed`` when every
    run's batches held one length (nothing to predict)."""

    seq_len: int
    source: str
    seen: int | None
    fixed: bool = False


def longest_batch(max_seq_len: int | None, max_positions: int | None,
                  experiments: Iterable[Experiment]) -> LongestBatch | None:
    """The longest batch: ``max_seq_len`` (``--max-seq-len``) first; ``max_positions`` (the model's ``n_positions``
    or ``max_position_embeddings``, None: unknown) where the lengths varied (a step of a run, or a run, held fewer
    tokens than another); else the longest of ``experiments`` seen (a guess, said so); one length throughout: that,
    ``fixed``. None without an option and without a run that recorded a length."""
    runs = [e for e in experiments if e.max_seq_len_seen and e.pad_seq_len is None]
    seen = max((e.max_seq_len_seen for e in runs), default=None)
    varied = (any(e.min_seq_len_seen != e.max_seq_len_seen for e in runs)
              or len({e.max_seq_len_seen for e in runs}) > 1)
    if max_seq_len:
        return LongestBatch(int(max_seq_len), "--max-seq-len", seen)
    if seen is None:
        return None
    if not varied:
        return LongestBatch(seen, f"every batch held {seen} tokens (a fixed-shape workload)", seen, fixed=True)
    if max_positions:
        return LongestBatch(int(max_positions), "the model's maximum positions (n_positions), which no batch "
                                                "can exceed", seen)
    return LongestBatch(seen, "the longest batch the runs saw: a guess, give --max-seq-len", seen)


def square_bytes(record: dict[str, int] | None) -> float:
    """``q``, bytes per sample per token squared that an attention kernel keeping a ``tokens x tokens`` matrix per
    head (eager, SDPA's math path) saves: saved / (mbs x seq_len^2) from the profile's
    `zerotune.probe.read_square_activations` record (None: 0; 0 too where the kernel keeps none, flash attention)."""
    if not record:
        return 0.0
    return record["square_saved_bytes"] / (record["micro_batch_size"] * record["square_seq_len"] ** 2)


def token_slope(memory: OnlineMemory, experiments: Iterable[Experiment], ds_config: dict,
                square: float = 0.0) -> float | None:
    """Bytes per token per sample of ``ds_config``'s family (`zerotune.model.online.family`), less the square term
    ``square`` (`square_bytes`) carries; None where no run of the family recorded its length. Each ok run's peak
    less the structural terms is fitted as ``c + a * mbs * seq_len`` (``a >= 0``) where the runs hold two lengths
    and two token counts; else the family line's slope over the length its runs saw (activations are linear in
    tokens)."""
    fam = family(memory.prior, ds_config)
    runs = [e for e in experiments if e.kind is not ExperimentKind.PROFILE and e.status is Status.OK
            and e.peak_memory_bytes and e.max_seq_len_seen and e.pad_seq_len is None
            and family(memory.prior, e.ds_config) == fam]
    if not runs:
        return None
    seen = max(e.max_seq_len_seen for e in runs)
    per_sample = memory.line(ds_config).slope / seen - square * seen
    points = [(float(e.mbs * e.max_seq_len_seen), float(e.peak_memory_bytes - memory.structural_bytes(
        e.ds_config, e.mbs) - square * e.mbs * e.max_seq_len_seen ** 2), 1.0) for e in runs]
    if len({e.max_seq_len_seen for e in runs}) < 2 or len({x for x, _, _ in points}) < 2:
        return max(0.0, per_sample)
    return fit_line(points, tie_slope=per_sample).slope


@dataclass(frozen=True)
class LongestCheck:
    """A config's peak at the longest batch, bytes per rank: ``measured_bytes`` (the mean over its runs) at ``seen``
    tokens (its runs' longest from step 2 on), ``predicted_bytes`` at ``longest`` tokens, against ``budget_bytes``.
    ``per_token_bytes``, ``per_square_bytes``: bytes per token and per token squared per sample (`token_slope`,
    `square_bytes`; 0: no square term)."""

    name: str
    mbs: int
    measured_bytes: int
    seen: int
    longest: int
    per_token_bytes: float
    predicted_bytes: int
    budget_bytes: int
    per_square_bytes: float = 0.0

    @property
    def fits(self) -> bool:
        return self.predicted_bytes <= self.budget_bytes

    @property
    def margin_bytes(self) -> int:
        """What the budget leaves at the longest batch (negative: over it)."""
        return self.budget_bytes - self.predicted_bytes

    def describe(self) -> str:
        """``z1_gas1_tmbspg8: measured peak 2.10 GiB at 128 tokens; at 1024 tokens 2.90 GiB predicted (8 samples x
        896 more tokens x 120 KiB per token per sample); budget 3.00 GiB, margin 0.10 GiB (3%)``."""
        scores = (f", and attention scores of {self.per_square_bytes:.1f} bytes per token squared per sample"
                  if self.per_square_bytes else "")
        return (f"{self.name}: measured peak {format_bytes(self.measured_bytes)} at {self.seen} tokens; at "
                f"{self.longest} tokens {format_bytes(self.predicted_bytes)} predicted ({self.mbs} sample(s) x "
                f"{max(0, self.longest - self.seen)} more tokens x {format_bytes(round(self.per_token_bytes))} per "
                f"token per sample{scores}); budget {format_bytes(self.budget_bytes)}, margin "
                f"{'-' if self.margin_bytes < 0 else ''}{format_bytes(abs(self.margin_bytes))} "
                f"({self.margin_bytes / self.budget_bytes:.0%})")


def check_longest(exp: Experiment, memory: OnlineMemory, experiments: Iterable[Experiment], longest: LongestBatch,
                  budget_bytes: int, square: float = 0.0) -> LongestCheck | None:
    """``exp``'s predicted peak at ``longest``: ``peak(L) = peak(seen) + a * mbs * (L - seen) + q * mbs * (L^2 -
    seen^2)``, ``peak(seen)`` the mean of its runs' peaks, ``a`` the `token_slope`, ``q`` = ``square``
    (`square_bytes`). None where ``exp`` has no measured peak or length, or its family no per-token term."""
    experiments = list(experiments)
    measured = memory.measured_bytes(exp.ds_config) or exp.peak_memory_bytes
    seen = max((e.max_seq_len_seen for e in experiments if (e.name == exp.name or e.replica_of == exp.name)
                and e.max_seq_len_seen), default=None)
    slope = token_slope(memory, experiments, exp.ds_config, square)
    if not measured or seen is None or slope is None:
        return None
    more = max(0, longest.seq_len - seen)
    predicted = round(measured + slope * exp.mbs * more + square * exp.mbs * ((seen + more) ** 2 - seen ** 2))
    return LongestCheck(exp.name, exp.mbs, int(measured), seen, longest.seq_len, slope, predicted, int(budget_bytes),
                        square)
