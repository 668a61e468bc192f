"""The report for programs: ``results.csv`` (one row per launch) and ``results.json`` (the rows and the tuning).

A row (`experiment_row`, columns `COLUMNS`) is one experiment: the summary's columns, tokens/s per device and MFU
(0..1, `zerotune.model.flops`), the predicted and measured peak per device, the start and wall time, ``startup_s``
(launch to the first measured step) and ``measure_s``, ``launch`` (``warm``, ``cold``, ``""`` not launched) and
``launch_note`` (why a run went cold), device-seconds, and ``origin`` (``launched`` or ``cached``). Memory is in
bytes, times in seconds, the metric in ``metric_unit``.
``results.json`` adds the tuning (`json_text`), which ``zerotune report`` reads back.
"""
from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import asdict
from typing import Any

from zerotune.core.experiment import Experiment
from zerotune.model.flops import tokens_per_device
from zerotune.report.data import ReportData, outcome
from zerotune.report.results import device_seconds
from zerotune.run.exprecord import ExpRecord

SCHEMA_VERSION = 1  # of results.json

COLUMNS = ("name", "space", "kind", "stage", "mbs", "gas", "knobs", "replica_of", "status", "outcome", "ended",
           "metric_name", "metric", "metric_unit", "metric_rel_half_width", "metric_source", "tokens_per_s_per_device",
           "mfu", "predicted_memory_bytes", "peak_memory_bytes", "memory_rel_error", "budget_bytes", "started_at",
           "wall_s", "startup_s", "measure_s", "launch", "launch_note", "num_nodes", "num_slots", "device_s",
           "exit_code", "error", "is_answer", "origin")
"""``results.csv``'s columns, in order."""


def experiment_row(exp: Experiment, data: ReportData) -> dict[str, Any]:
    """One launch as a row of `COLUMNS`: ``started_at`` in ISO 8601 UTC (``""`` unknown), ``knobs`` as JSON, numbers
    as numbers, None where unknown (``startup_s`` and ``measure_s`` without the step probe)."""
    return {
        "name": exp.name, "space": exp.space, "kind": exp.kind.value, "stage": exp.stage,
        "mbs": exp.ds_config.get("train_micro_batch_size_per_gpu"), "gas": exp.gas,
        "knobs": json.dumps(exp.knobs, sort_keys=True) if exp.knobs else "", "replica_of": exp.replica_of,
        "status": exp.status.value if exp.status else None, "outcome": outcome(exp), "ended": exp.ended,
        "metric_name": data.objective.name, "metric": exp.metric, "metric_unit": data.objective.unit,
        "metric_rel_half_width": exp.metric_rel_half_width, "metric_source": exp.metric_source,
        "tokens_per_s_per_device": tokens_per_device(exp), "mfu": data.mfu(exp),
        "predicted_memory_bytes": exp.memory_bytes, "peak_memory_bytes": exp.peak_memory_bytes,
        "memory_rel_error": exp.memory_rel_error, "budget_bytes": data.budget_bytes,
        "started_at": iso_time(exp.started_at), "wall_s": exp.wall_s, "startup_s": exp.startup_s,
        "measure_s": exp.measure_s, "launch": exp.launch, "launch_note": exp.launch_note, "num_nodes": exp.num_nodes,
        "num_slots": exp.num_slots, "device_s": device_seconds(exp), "exit_code": exp.exit_code, "error": exp.error,
        "is_answer": data.answer is not None and exp.name == data.answer.name, "origin": data.origin(exp),
    }


def iso_time(epoch_s: float | None) -> str:
    """``2026-11-26T19:02:26.123Z`` (UTC, milliseconds); ``""`` for None."""
    if epoch_s is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_s)) + f".{int(epoch_s % 1 * 1000):03d}Z"


def csv_text(data: ReportData) -> str:
    """``results.csv``: a header of `COLUMNS`, then one row per launch in launch order."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for exp in data.experiments:
        writer.writerow({k: _cell(v) for k, v in experiment_row(exp, data).items()})
    return out.getvalue()


def _cell(value: Any) -> Any:
    """A csv cell: None empty; a text a spreadsheet would read as a formula (first character ``=``, ``+``, ``-``,
    ``@``, tab or CR) after a ``'`` (OWASP's CSV injection advice); numbers as they are."""
    if value is None:
        return ""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def json_text(data: ReportData) -> str:
    """``results.json``: ``{"schema_version", "tuning", "answer", "runner_up", "projection", "experiments",
    "records"}``; ``tuning`` holds the state, objective, budget, exps dir and what was not run and why; ``records``
    each run's verified ``exp.json`` record (without its resume key), from which `zerotune.report.disk.load` rebuilds
    the report where the exps dir is gone (D327)."""
    runner_up, projection = data.runner_up(), data.projection()
    tuning = {"state": data.state, "written_at": iso_time(data.written_at), "objective": data.objective.name,
              "unit": data.objective.unit, "budget_bytes": data.budget_bytes, "exps_dir": str(data.exps_dir.resolve()),
              "context": data.context, **data.plan.to_json(), "since": data.since, "elapsed_s": data.elapsed_s,
              "strategy_known": data.strategy_known, "not_run": [{"what": n.what, "reason": n.reason}
                                                                for n in data.not_run], "notes": data.notes}
    body = {"schema_version": SCHEMA_VERSION, "tuning": tuning,
            "answer": data.answer.name if data.answer is not None else None,
            "answer_metric": data.pooled[data.answer.name].value if data.answer is not None else None,
            "answer_rel_half_width": data.answer_half_width,
            "runner_up": None if runner_up is None else {**asdict(runner_up), "beyond_noise": runner_up.beyond_noise},
            "projection": None if projection is None else asdict(projection),
            "experiments": [experiment_row(e, data) for e in data.experiments],
            "records": [ExpRecord(e).to_dict() for e in data.experiments]}
    return json.dumps(body, indent=1, allow_nan=False, default=str) + "\n"
