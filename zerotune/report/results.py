"""The answer, rendered from `zerotune.report.data.ReportData`, in files readable without zerotune:
``ds_config_optimal.json`` (concrete values, no ``autotuning`` section, loadable by DeepSpeed), ``cmd_optimal.txt``
(the ``deepspeed`` command) and ``summary.txt`` (the summary of every tuning space, printed at the end).
"""
from __future__ import annotations

import copy
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rich.console import Console
from rich.table import Table

from zerotune.core.experiment import LAUNCH_COLD, LAUNCH_WARM, Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled
from zerotune.core.stopping import EARLY_ENDS, steps_to_precision
from zerotune.core.units import format_bytes
from zerotune.deepspeed.keys import CHECKPOINTING, ZERO
from zerotune.model.flops import tokens_per_device
from zerotune.model.zero_options import ZeroOptions
from zerotune.run.store import write_json_atomic, write_text_atomic
from zerotune.strategy.answer import IMPRECISE

if TYPE_CHECKING:
    from zerotune.report.data import ReportData


def saver_names(ds_config: dict) -> list[str]:
    """The memory savers and the parallel degrees a config uses, as the summary and the report's plots name them, in
    the savers phase's order: ``bf16 states`` (16-bit master weights), ``AutoTP 2``, ``Ulysses 4``,
    ``checkpointing``, ``offload optimizer (cpu)`` (``(cpu, ratio 0.5)`` for a partial offload), ``offload params
    (cpu)``, ``hpZ 8`` (`zerotune.model.zero_options.ZeroOptions` reads each)."""
    zero = ds_config.get(ZERO) if isinstance(ds_config.get(ZERO), dict) else {}
    options = ZeroOptions.of(ds_config)
    names = ["bf16 states"] if options.master_bytes == 2 else []
    names += [f"AutoTP {options.tp}"] * (options.tp > 1) + [f"Ulysses {options.sp}"] * (options.sp > 1)
    names += ["checkpointing"] if ds_config.get(CHECKPOINTING) is True else []
    for key, name in (("offload_optimizer", "offload optimizer"), ("offload_param", "offload params")):
        device = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key), dict) else "none"
        if device not in ("none", None):
            ratio = f", ratio {options.offload_ratio:g}" if key == "offload_optimizer" and options.offload_ratio < 1 \
                else ""
            names.append(f"{name} ({device}{ratio})")
    return names + [f"hpZ {options.hpz}"] * (options.hpz > 1)


def optimal_config(exp: Experiment) -> dict:
    """The experiment's config as a user runs it: no ``autotuning`` section."""
    cfg = copy.deepcopy(exp.ds_config)
    cfg.pop("autotuning", None)
    return cfg


@dataclass
class SpaceSummary:
    """One row of the summary: a tuning space (``z1``, ``z1_knobs``...)."""

    space: str
    experiments: int
    ok: int
    failed: dict[str, int]
    best: Experiment | None
    device_s: float = 0.0


def device_seconds(exp: Experiment) -> float:
    """What an experiment cost: wall time x devices it held, seconds (0 when it did not run)."""
    return (exp.wall_s or 0.0) * exp.num_nodes * exp.num_slots


def cost_line(experiments: Sequence[Experiment]) -> str:
    """The tuning cost in device-hours, the share spent on experiments that gave no metric, and the
    share spent on experiments zerotune ended early (`zerotune.core.stopping`), with how many."""
    total = sum(device_seconds(e) for e in experiments)
    wasted = sum(device_seconds(e) for e in experiments if e.status != Status.OK)
    early = [e for e in experiments if e.status == Status.OK and e.ended in EARLY_ENDS]
    share = f", {wasted / total:.0%} of it on experiments that did not finish ok" if total else ""
    if total and early:
        share += (f", {sum(device_seconds(e) for e in early) / total:.0%} on {len(early)} ended early "
                  f"(precise or cannot beat the best)")
    return f"tuning cost: {total / 3600:.3g} device-hours (wall time x devices){share}"


def plan_line(launches: int, device_s: float, experiments: Sequence[Experiment]) -> str:
    """The cost plan made once the profile ran (``launches``, ``device_s`` device-seconds: the dry run's plan on the
    profiled memory model) against what ``experiments`` spent, re-measurements counted; the profile is in neither."""
    spent = [e for e in experiments if e.kind is not ExperimentKind.PROFILE and e.status is not Status.REFUSED]
    replicas = sum(1 for e in spent if e.replica_of)
    return (f"cost plan: {launches} launch(es), {device_s / 3600:.3g} device-hours planned once the profile ran (the "
            f"strategy on its memory model, each launch at the profile's device-seconds); spent {len(spent)} launch(es)"
            f" ({replicas} re-measurement(s)), {sum(device_seconds(e) for e in spent) / 3600:.3g} device-hours")


def unplanned_lines(planned: frozenset[str], experiments: Sequence[Experiment]) -> list[str]:
    """One line per launch of ``experiments`` not among the ``planned`` names (the profile, refused and skipped runs
    are no launches): the rule that bought it (``Experiment.bought_by``) and how it ended (D325)."""
    extra = [e for e in experiments if e.kind is not ExperimentKind.PROFILE and e.status is not None
             and e.status not in (Status.REFUSED, Status.SKIPPED) and e.name not in planned]
    return [f"not in the plan: {e.name} ({e.status.value}), bought by "
            f"{e.bought_by or 'a rule not recorded'}" for e in extra]


def startup_line(experiments: Sequence[Experiment], since: float | None = None) -> str | None:
    """The start-up share of the launches and how they started, e.g. ``start-up: 41% of launch seconds (12.3 s of
    30.1 s over 7 launches); launches: 5 warm, 2 cold (re-run cold: its warm server went away during the run)``.

    The share is ``sum(startup_s) / sum(wall_s)`` over the launches with both, then the cold launches' distinct
    ``launch_note`` in first-seen order. Only launches from ``since`` (the tuning's start, seconds since the epoch;
    None: all) count: a run reused on resume paid its start-up earlier. None when no launch has a start-up time.
    """
    now = [e for e in experiments if since is None or (e.started_at is not None and e.started_at >= since)]
    timed = [e for e in now if e.startup_s is not None and e.wall_s]
    if not timed:
        return None
    startup, wall = sum(e.startup_s for e in timed), sum(e.wall_s for e in timed)
    line = (f"start-up: {startup / wall:.0%} of launch seconds ({startup:.1f} s of {wall:.1f} s over "
            f"{len(timed)} launch{'' if len(timed) == 1 else 'es'})")
    counts = [(n, how) for how in (LAUNCH_WARM, LAUNCH_COLD) if (n := sum(e.launch == how for e in now))]
    if counts:
        notes = list(dict.fromkeys(e.launch_note for e in now if e.launch == LAUNCH_COLD and e.launch_note))
        line += "; launches: " + ", ".join(f"{n} {how}" for n, how in counts) + (
            f" ({'; '.join(notes)})" if notes else "")
    return line


def summarize(data: "ReportData") -> list[SpaceSummary]:
    """Group the report's experiments by tuning space, in first-seen order; each space's best by pooled metric."""
    rows: dict[str, SpaceSummary] = {}
    pooled, objective = data.pooled, data.objective
    for exp in data.experiments:
        row = rows.setdefault(exp.space, SpaceSummary(exp.space, 0, 0, {}, None))
        row.experiments += 1
        row.device_s += device_seconds(exp)
        if exp.status == Status.OK:
            row.ok += 1
            if exp.replica_of is None and exp.name in pooled and (
                    row.best is None or objective.better(pooled[exp.name].value, pooled[row.best.name].value)):
                row.best = exp
        elif exp.status is not None:
            row.failed[exp.status.value] = row.failed.get(exp.status.value, 0) + 1
    return list(rows.values())


def render_table(data: "ReportData") -> Table:
    """The summary as a rich table (also ``summary.txt``); the answer is starred as its tuning space's best. Its
    caption: `cost_line`, `startup_line` (where known), then the report's notes."""
    objective, overall, pooled = data.objective, data.answer, data.pooled
    table = Table(title=f"zerotune: {len(data.experiments)} experiments ({data.launched} launched now), "
                        f"tuning time {data.elapsed_s or 0.0:.1f} s", title_justify="left")
    for col in ("tuning space", "experiments", "ok", "not ok", "device-h", f"best {objective.name} ({objective.unit})",
                "best experiment"):
        table.add_column(col)
    for row in summarize(data):
        if overall is not None and overall.space == row.space:
            row.best = overall  # the answer, which the curve's shape may put at another mbs
        failed = ", ".join(f"{n} {s}" for s, n in sorted(row.failed.items())) or "-"
        best = "-" if row.best is None else _metric_text(pooled[row.best.name], row.best)
        name = "-" if row.best is None else row.best.name + (" *" if row.best is overall else "")
        table.add_row(row.space, str(row.experiments), str(row.ok), failed, f"{row.device_s / 3600:.3g}", best, name)
    startup = startup_line(data.experiments, data.since)
    notes = [cost_line(data.experiments), *([startup] if startup else []), *data.notes]
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


def answer_text(data: "ReportData") -> str:
    """The summary's answer lines (``data`` has an answer): the optimal config, its metric with the 95% interval of
    what a run of it gives (`ReportData.answer_half_width`) and the run-to-run noise
    (`zerotune.core.noise.run_noise`)."""
    best, objective = data.answer, data.objective
    pooled = data.pooled[best.name]
    savers = "".join(f", {name}" for name in saver_names(best.ds_config))
    return (f"\nOptimal: {best.name} (ZeRO stage {best.stage}{savers}, mbs {best.mbs}, gas {best.gas}), "
            f"{objective.name} {pooled.value:.4g} ±{data.answer_half_width:.1%} {objective.unit} (95%, mean of "
            f"{pooled.runs} run(s): each run's own interval and the run-to-run noise)\n{data.noise.describe()}\n"
            + "".join(f"{line}\n" for line in [tokens_line(data, best), imprecise_note(data)] if line))


def tokens_line(data: "ReportData", exp: Experiment) -> str | None:
    """``12,345 tokens/s per device, MFU 41.2% (MFU: 6 * ... against ...)`` for ``exp``'s own run; None without
    its tokens/s (a batch without token ids)."""
    per_device = tokens_per_device(exp)
    if per_device is None:
        return None
    mfu = data.mfu(exp)
    how = f" ({data.flops.describe()})" if data.flops is not None else ""
    return f"{per_device:,.0f} tokens/s per device" + (f", MFU {mfu:.1%}" if mfu is not None else "") + how


def imprecise_note(data: "ReportData") -> str | None:
    """The summary's line where the answer's half-width is over `IMPRECISE` times the precision: which part dominates,
    its runs' own intervals (more steady steps narrow them) or the run-to-run noise (only more runs average it down);
    None for an answer known well enough (D326)."""
    width, precision, best = data.answer_half_width, data.precision, data.answer
    if best is None or width is None or not precision or width <= IMPRECISE * precision:
        return None
    runs = data.answer_runs
    within = statistics.fmean((e.metric_rel_half_width or 0.0) ** 2 for e in runs)
    noise = (2 * data.noise.sigma) ** 2
    head = f"imprecise: the answer is known to ±{width:.1%}, over {IMPRECISE}x the precision (±{precision:.1%}): "
    if within >= noise:
        run = max(runs, key=lambda e: e.metric_rel_half_width or 0.0)
        ended = f", ended: {run.ended}" if run.ended else ""
        more = (f"; about {math.ceil(steps_to_precision(run.steady_steps, run.metric_rel_half_width, precision))} "
                "more steady steps would reach it (the script's length or autotuning.end_profile_step bounds them)"
                if run.steady_steps and run.metric_rel_half_width else "")
        return (f"{head}its run's own interval dominates ({run.name}: ±{run.metric_rel_half_width or 0.0:.1%} over "
                f"{run.steady_steps or 0} steady steps{ended}){more}")
    k = math.ceil((within + noise) / precision ** 2)
    return (f"{head}the run-to-run noise dominates (sigma {data.noise.sigma:.1%} over {len(runs)} run(s)); about "
            f"{k} runs of it would average it down to the precision (more steps would not)")


def _metric_text(pooled: Pooled, exp: Experiment) -> str:
    """``12.3 ±2%`` for one run with an interval, ``12.3 (2 runs, spread 4%)`` for a pooled one."""
    if pooled.runs > 1:
        return f"{pooled.value:.4g} ({pooled.runs} runs, spread {pooled.rel_spread:.0%})"
    return f"{pooled.value:.4g}" + (f" ±{exp.metric_rel_half_width:.0%}" if exp.metric_rel_half_width else "")


def memory_table(experiments: Sequence[Experiment]) -> Table | None:
    """The memory model checked: predicted vs measured peak bytes per rank of each experiment with both, with the
    median and worst absolute error; None when none has both. An OOM run's peak is a lower bound (at least the budget),
    not a measurement: its row says so and the error leaves it out."""
    rows = [e for e in experiments if e.memory_rel_error is not None]
    if not rows:
        return None
    table = Table(title="memory per rank: the memory model's prediction vs the measured peak", title_justify="left")
    for col in ("experiment", "status", "predicted", "measured peak", "error"):
        table.add_column(col)
    oom = [e for e in rows if e.status is not None and e.status.over_budget]
    for e in rows:
        table.add_row(e.name, e.status.value if e.status else "-", format_bytes(e.memory_bytes),
                      format_bytes(e.peak_memory_bytes),
                      "over the budget" if e in oom else f"{e.memory_rel_error:+.1%}")
    errors = [abs(e.memory_rel_error) for e in rows if e not in oom]
    scored = (f"{len(errors)} runs: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"
              if errors else "no run measured to its peak")
    left_out = f" ({len(oom)} out of memory left out: their peak is at least the budget)" if oom else ""
    table.caption = (f"{scored}{left_out} (the peak is what the budget limits: on CUDA the device's at each step, the "
                     "allocator's reserved high-water mark plus what lies outside it; on CPU the largest VmData, "
                     "sampled every 5 ms)")
    table.caption_justify = "left"
    return table


def table_text(table: Table) -> str:
    """The table as plain text for ``summary.txt``: 140 columns, or wider so that no name is cut or wrapped."""
    with open(os.devnull, "w") as sink:
        width = max(140, natural_width(Console(width=140, file=sink), table))
        console = Console(width=width, record=True, file=sink, color_system=None)
        console.print(table)
    return console.export_text()


def print_wide(console: Console, renderable) -> None:
    """Print a table whole: on a terminal as rich fits it; elsewhere (a CI log, ``| tee``, a file), where rich
    would assume 80 columns and cut names to "...", at its natural width."""
    if console.is_terminal:
        console.print(renderable)
    else:
        width = max(console.width, natural_width(console, renderable))  # rich caps print(width=) at its own
        Console(file=console.file, width=width, color_system=console.color_system, no_color=console.no_color,
                force_terminal=False).print(renderable, crop=False)


def natural_width(console: Console, renderable) -> int:
    """The columns ``renderable`` takes unconstrained (a table: every cell on one line)."""
    return console.measure(renderable, options=console.options.update_width(10_000)).maximum


def write_results(results_dir: Path, data: "ReportData", answer_for: callable) -> Experiment | None:
    """Write ``summary.txt`` of ``data`` and, when it has an answer, the optimal config and command; returns the
    answer, or None (then no optimal files are written, and stale ones are removed).

    Each file is written whole or not at all (`zerotune.run.store.write_text_atomic`), every text made before the
    first is written; the config first, the summary last. The caller keeps a stop signal from landing between them
    (`zerotune.autotuner.Autotuner.tune`), so the files agree.

    Args:
        answer_for: ``answer_for(config_path, ds_config) -> (command, {name: text})``: the launcher command for the
            config to be written at ``config_path`` and the files it needs beside it (the Accelerate config), written
            after the config and before the command.
    """
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    best = data.answer
    text = table_text(render_table(data))
    config_path = results_dir / "ds_config_optimal.json"
    cmd_path = results_dir / "cmd_optimal.txt"
    if best is None:
        text += "\nNo experiment succeeded: there is no optimal configuration.\n"
    else:
        text += answer_text(data)
        config = optimal_config(best)
        # the command names the file (not a link's target) and maps the config's values it will hold
        command, files = answer_for(str(results_dir.resolve() / config_path.name), config)
        command += "\n"
    memory = memory_table(data.experiments)
    if memory is not None:
        text += "\n" + table_text(memory)
    if best is None:
        config_path.unlink(missing_ok=True)
        cmd_path.unlink(missing_ok=True)
    else:
        write_json_atomic(config_path, config)
        for name, file_text in files.items():
            write_text_atomic(results_dir / name, file_text)
        write_text_atomic(cmd_path, command)
    write_text_atomic(results_dir / "summary.txt", text)
    return best
