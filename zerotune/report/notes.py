"""The summary's caption lines on what the strategy did and why (`strategy_notes`): each stage's decision, what was
not launched and why, the tie and the re-measurements, the memory model and its fit, and the run length where the
script's own end cut runs short of the precision (`run_length_note`, D323).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective
from zerotune.core.stopping import EndReason, steps_to_precision
from zerotune.core.units import format_bytes
from zerotune.model.coverage import unmodelled_keys
from zerotune.model.zero_options import approximations
from zerotune.strategy.answer import TIE_ORDER

if TYPE_CHECKING:
    from zerotune.strategy.answer import Tie
    from zerotune.strategy.result import StrategyResult


def strategy_notes(result: "StrategyResult", device_memory_bytes: int, dp_world_size: int) -> list[str]:
    """The summary's caption: why the tuning stopped early, each ZeRO stage's decision and why, the candidates the
    throughput model kept from launching and those the memory model refused, with their predictions, the
    re-measurements, and the memory model's inputs and fit."""
    notes = [f"stopped early: {result.stopped}; the answer is the best of what ran"] if result.stopped else []
    notes += result.stop_bound.describe() if result.stop_bound is not None else []
    notes += [f"{r.label}: {r.decision.value} - {r.reason}"
              + (f"; mbs search stopped: {r.trace.stop.value}" if r.trace.stop else "")
              for r in result.stages if r.decision is not None]
    notes += result.savers_notes
    notes += [f"not launched: {p.name}: {p.reason}" for p in result.predictions]
    notes += [f"{e.name}: {e.error}" for e in result.experiments if e.status is Status.REFUSED]
    notes += result.longest.notes()
    if result.ledger.tie is not None:
        notes.append(tie_note(result.ledger.tie, result.ledger.precision, result.ledger.objective))
    replicas = [e for e in result.experiments if e.replica_of]
    if replicas:
        configs = sorted({e.replica_of for e in replicas})
        first, answer = result.ledger.first_run_answer, result.ledger.answer
        changed = (f"they changed the answer from {first.name} to {answer.name}"
                   if first is not None and answer is not None and first.name != answer.name
                   else "the first runs alone give the same answer")
        notes.append(f"re-measurements: {len(replicas)} run(s) of {', '.join(configs)} (where one run could not tell "
                     f"configs apart by more than the target precision); {changed}")
    if result.memory is not None:
        prior = result.memory.prior
        ckpt = prior.checkpointed_activation_bytes_per_sample
        notes.append(f"memory model: {prior.num_params:,} params, {format_bytes(prior.activation_bytes_per_sample)}"
                     f" activations/sample" + (f" ({format_bytes(ckpt)} with checkpointing)" if ckpt else "")
                     + f", overhead {format_bytes(prior.overhead_bytes)} (the profile's), budget "
                     f"{format_bytes(device_memory_bytes)} per rank, DP world size {dp_world_size}")
        notes += result.memory.describe()
    unmodelled = list(dict.fromkeys(k for e in result.experiments for k in unmodelled_keys(e.ds_config)))
    if unmodelled:
        notes.append(f"not in the memory model: {', '.join(unmodelled)} (set in the launched configs): its "
                     "predictions for them leave these keys out; what they move is in the measured peaks only")
    notes += [f"memory model: {n}" for n in dict.fromkeys(n for e in result.experiments
                                                         for n in approximations(e.ds_config))]
    return notes


def run_length_note(experiments: Sequence[Experiment], answer: Experiment | None, precision: float | None,
                    flag: str | None, raised: bool) -> str | None:
    """The summary's line where runs ended at the script's own last step (``ended`` ``script_end``) short of
    ``precision``: how many, how many more steady steps the answer's run (else the neediest) would have needed
    (`zerotune.core.stopping.steps_to_precision`), and the script's steps ``flag`` (``raised``: zerotune raised it,
    ``autotuning.max_steps_arg``; None: no known flag); None where no run ended so (D323)."""
    short = [e for e in experiments if e.status is Status.OK and e.ended == EndReason.SCRIPT_END.value
             and e.steady_steps and e.metric_rel_half_width and precision
             and e.metric_rel_half_width > precision]
    if not short:
        return None
    ok = sum(1 for e in experiments if e.status is Status.OK and e.kind is not ExperimentKind.PROFILE)
    needs = {e.name: math.ceil(steps_to_precision(e.steady_steps, e.metric_rel_half_width, precision))
             for e in short}
    run = answer if answer is not None and answer.name in needs else max(short, key=lambda e: needs[e.name])
    which = "the answer" if run is answer else "the least precise"
    if raised:
        how = (f"{flag} was raised for them (autotuning.max_steps_arg), yet the script ended first: check that {flag} "
               "sets its length")
    elif flag:
        how = (f"the command's {flag} sets the script's length: with \"autotuning\": {{\"max_steps_arg\": "
               f"\"{flag}\"}} zerotune raises it for its runs")
    else:
        how = ("name the script's flag for its length in steps as autotuning.max_steps_arg (such as \"--max_steps\") "
               "and zerotune raises it for its runs")
    return (f"run length: {len(short)} of {ok} run(s) ended at the script's own last step before the precision "
            f"(±{precision:.1%}); {which}, {run.name}, was known to ±{run.metric_rel_half_width:.1%} over "
            f"{run.steady_steps} steady steps, and about {needs[run.name]} more (its step times' measured variance) "
            f"would have reached ±{precision:.1%}; {how}")


def tie_note(tie: "Tie", precision: float | None, objective: Objective | None) -> str:
    """The summary's line for a tie (`zerotune.strategy.answer.Tie`): every tied config with its figure
    and measured peak, and what the tie order took the answer for; no run was launched to break it."""
    unit = objective.unit if objective is not None else ""

    def figure(exp: Experiment, value: float) -> str:
        peak = f", peak {format_bytes(exp.peak_memory_bytes)}" if exp.peak_memory_bytes else ""
        width = f" ±{tie.half_widths[exp.name]:.1%}" if exp.name in tie.half_widths else ""
        return f"{exp.name} {value:.4g}{width} {unit}{peak}"

    within = f" within --precision {precision:.1%}" if precision is not None else ""
    return (f"tie: {figure(tie.answer, tie.value)} and " + ", ".join(figure(e, v) for e, v in tie.others)
            + f" read{within} of each other; the answer is {tie.answer.name}, for {tie.reason} (the tie order: "
            f"{TIE_ORDER}; no run breaks a tie)")
