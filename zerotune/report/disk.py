"""The report read back from a results dir on disk (`load`, for ``zerotune report``): the runs from the verified
``exp.json`` records and from ``results.json``'s own ``records``, what only the tuner knew from that
``results.json`` (`SavedTuning`). From ``results.json`` alone the report is the live one, byte for byte (D327).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from zerotune.core.errors import ConfigError, RecordError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.objective import Objective
from zerotune.core.stopping import DEFAULT_PRECISION
from zerotune.report.data import RESULTS_JSON, STATES, NotRun, ReportData, TrainingPlan, launch_order
from zerotune.run.exprecord import ExpRecord, load_records
from zerotune.run.store import RECORD_FILE, read_json
from zerotune.strategy.answer import best_experiment


@dataclass(frozen=True)
class SavedTuning:
    """The ``tuning`` section of a ``results.json`` (`zerotune.report.table_export.json_text`) as `load` reads it:
    what only the tuner knew, in `ReportData`'s terms. A field missing, or of another type than zerotune writes, is
    None (empty for ``not_run`` and ``notes``): a damaged or foreign file is read as far as it is right, never fatal.

    Attributes:
        strategy_known: whether the tuner knew what the strategy did not run (False where the section lacks it).
        found: whether the section holds any of these fields as zerotune writes it.
        answer, cached: the file's top-level ``answer`` (the ledger's) and its rows with ``origin`` ``cached``, by name.
        records: the runs of its ``records`` that verify (`zerotune.run.exprecord.ExpRecord.from_dict`), in order.
        written_at: when it was written, seconds since the epoch, to the millisecond it records.
    """

    exps_dir: str | None = None
    context: dict[str, Any] | None = None
    state: str | None = None
    strategy_known: bool = False
    not_run: tuple[NotRun, ...] = ()
    notes: tuple[str, ...] = ()
    plan: TrainingPlan = TrainingPlan()
    since: float | None = None
    elapsed_s: float | None = None
    found: bool = False
    answer: str | None = None
    cached: frozenset[str] = frozenset()
    records: tuple[Experiment, ...] = ()
    written_at: float | None = None

    @classmethod
    def read(cls, path: Path) -> "SavedTuning":
        """The section of the ``results.json`` at ``path``, its answer and cached rows; ``found`` False without one."""
        body = read_json(path) or {}
        tuning, answer, rows = body.get("tuning"), body.get("answer"), body.get("experiments")
        saved = cls.from_dict(tuning) if isinstance(tuning, dict) else cls()
        cached = frozenset(r["name"] for r in (rows if isinstance(rows, list) else ())
                           if isinstance(r, dict) and r.get("origin") == "cached" and isinstance(r.get("name"), str))
        return replace(saved, answer=answer if isinstance(answer, str) else None, cached=cached,
                       records=_verified(body.get("records")), written_at=_epoch(saved.found and tuning.get("written_at")))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SavedTuning":
        """The section from its decoded JSON object, each field validated as the class docstring says."""
        kept = {k: v for k, v in data.items() if k in _SAVED_TYPES and isinstance(v, _SAVED_TYPES[k])
                and isinstance(v, bool) == (k == "strategy_known")}
        not_run = tuple(NotRun(str(n.get("what", "")), str(n.get("reason", "")))
                        for n in kept.get("not_run", []) if isinstance(n, dict))
        plan = TrainingPlan(kept.get("train_samples"), kept.get("train_steps"), kept.get("cost_per_device_hour"),
                            kept.get("peak_tflops"))
        return cls(kept.get("exps_dir"), kept.get("context"), kept.get("state"),
                   kept.get("strategy_known", False), not_run, tuple(str(n) for n in kept.get("notes", [])),
                   plan, kept.get("since"), kept.get("elapsed_s"), found=bool(kept))


def _verified(records: Any) -> tuple[Experiment, ...]:
    """The experiments of a ``results.json``'s ``records`` that verify as ``exp.json`` does; the rest left out."""
    out = []
    for data in records if isinstance(records, list) else ():
        try:
            out.append(ExpRecord.from_dict(data).experiment)
        except (RecordError, AttributeError, TypeError, ValueError):
            continue
    return tuple(out)


def _epoch(iso: Any) -> float | None:
    """Seconds since the epoch of ``2026-11-26T19:02:26.123Z`` (`zerotune.report.table_export.iso_time`), half a
    millisecond in, so that it formats back to the same text; None for anything else."""
    try:
        moment = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        return None
    return round(moment.timestamp() * 1000) / 1000 + 0.0005


_SAVED_TYPES = {"exps_dir": str, "context": dict, "state": str, "strategy_known": bool, "not_run": list,
                "notes": list, "train_samples": int, "train_steps": int, "cost_per_device_hour": (int, float),
                "peak_tflops": (int, float), "since": (int, float), "elapsed_s": (int, float)}



def load(results_dir: Path, exps_dir: Path | None = None, plan: TrainingPlan | None = None) -> ReportData:
    """The report of the tuning whose results are in ``results_dir``, finished, running or interrupted.

    The runs: the verified ``exp.json`` records under ``exps_dir`` (default: the one ``results.json`` names, else
    ``<results_dir>/exps``) with ``results.json``'s resume context, else the latest record's (an exps dir may hold
    runs of other inputs), then the runs of ``results.json``'s ``records`` no ``exp.json`` holds. The objective and
    budget come from that context; the answer is the one ``results.json`` names where it ran ok, else recomputed
    (`zerotune.strategy.answer.best_experiment`); the state from the files (`_state_on_disk`). With no ``exp.json``
    read, the state and time written are ``results.json``'s: its report again (D327). ``plan``, the training run to
    project, goes over the one ``results.json`` records.

    Raises:
        ConfigError: ``results_dir`` is not a directory, neither it nor ``exps_dir`` holds any zerotune result, or an
            ``exps_dir`` given holds no record.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ConfigError(f"{results_dir}: not a directory: expected a zerotune results dir (autotuning.results_dir "
                          f"or --results-dir)")
    tuning = SavedTuning.read(results_dir / RESULTS_JSON)
    records = load_records(Path(exps_dir)) if exps_dir else []
    if exps_dir and not records:  # a typo would otherwise rewrite results.json as a tuning with no run
        raise ConfigError(f"--exps-dir {exps_dir}: no experiment record of zerotune's there (exp.json in each "
                          f"experiment's directory): expected the tuning's exps dir")
    exps_dir = Path(exps_dir or tuning.exps_dir or results_dir / "exps")
    records = records or load_records(exps_dir)
    if not records and not tuning.found:
        found = "no " + RESULTS_JSON if not (results_dir / RESULTS_JSON).exists() else \
            f"a {RESULTS_JSON} that is not zerotune's (no 'tuning' section)"
        raise ConfigError(f"{results_dir}: {found} and no experiment records under {exps_dir}: expected a "
                          f"zerotune results dir (pass --exps-dir where the experiments went elsewhere)")
    context = tuning.context or (max(records, key=lambda r: r.recorded_at).resume_context if records else {})
    on_disk = [r.experiment for r in records if r.resume_context == context]
    runs = sorted(on_disk + [e for e in tuning.records if e.name not in {d.name for d in on_disk}], key=launch_order)
    objective = Objective.named(context.get("objective") or "throughput")
    budget = context.get("device_memory_bytes") if isinstance(context.get("device_memory_bytes"), int) else None
    capacity = None if context.get("cpu", True) else budget
    precision = context.get("precision") or DEFAULT_PRECISION  # without adaptive runs, the strategy's default
    answer = next((e for e in runs if e.name == tuning.answer and e.replica_of is None and e.status is Status.OK
                   and e.metric is not None), None) or best_experiment(runs, objective, capacity, precision)
    saved_only = not on_disk and tuning.state in STATES and tuning.written_at is not None
    state = tuning.state if saved_only else _state_on_disk(results_dir, exps_dir, runs, answer)
    return ReportData(runs, objective, budget, capacity, answer, exps_dir, list(tuning.not_run), list(tuning.notes),
                      state, context, (plan or TrainingPlan()).over(tuning.plan), strategy_known=tuning.strategy_known,
                      precision=precision, cached=tuning.cached, since=tuning.since, elapsed_s=tuning.elapsed_s,
                      **({"written_at": tuning.written_at} if saved_only else {}))


def _state_on_disk(results_dir: Path, exps_dir: Path, runs: list[Experiment], answer: Experiment | None) -> str:
    """The state from the files (``results.json``'s may be stale): ended when ``summary.txt``, written however a
    tuning ends, is newer than every record, then interrupted, finished or failed by its runs; else running."""
    try:
        summary = (results_dir / "summary.txt").stat().st_mtime
        newest = max((p.stat().st_mtime for p in exps_dir.glob(f"*/{RECORD_FILE}")), default=0.0)
    except OSError:
        return "running"
    if summary < newest:
        return "running"
    if any(e.status in (None, Status.INTERRUPTED) for e in runs):
        return "interrupted"
    return "finished" if answer is not None else "failed"

