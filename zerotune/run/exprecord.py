"""An experiment's record, ``exp.json``: what it holds (`ExpRecord`), its schema version and digests, its writing
and reading back.

A record that does not verify is said in the log and run again, never trusted and never fatal (`load_record`).
Where records live and which directories are zerotune's is `zerotune.run.store`'s.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from zerotune.core.errors import RecordError
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.deepspeed.canonical import config_hash
from zerotune.run.store import RECORD_FILE, read_json, read_object, write_json_atomic

__all__ = ["ExpRecord", "RECORD_VERSION", "config_digest", "load_record", "load_records", "record_digest",
           "write_record"]

logger = logging.getLogger(__name__)

RECORD_VERSION = 1  # of exp.json's schema (record_version, record_digest); a record of another is run again


def config_digest(ds_config: dict) -> str:
    """A short content hash of a config (canonical JSON, 5e8 == 500000000) for a person reading ``exp.json``; resume
    matches on the full resume key."""
    return config_hash(ds_config)[:12]


def record_digest(data: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a record's canonical JSON without its ``record_digest``: any edit or damage changes it."""
    body = json.loads(json.dumps({k: v for k, v in data.items() if k != "record_digest"}))
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class ExpRecord:
    """An experiment's record, ``exp.json``: the `Experiment`'s fields, then ``config_digest``, ``resume_key``,
    ``resume_context``, ``recorded_at``, ``record_version`` and, last, the ``record_digest`` of all of that.

    Attributes:
        experiment: the experiment as it stood when recorded (INTERRUPTED before its launch, then its outcome).
        resume_key: what makes it the same experiment on a rerun (`zerotune.run.resume.resume_key`).
        resume_context: what went into ``resume_key`` besides the config, so a person can see why it re-ran.
        recorded_at: when it was written, local time, ``%Y-%m-%dT%H:%M:%S``.
    """

    experiment: Experiment
    resume_key: str = ""
    resume_context: dict[str, Any] = field(default_factory=dict)
    recorded_at: str = ""

    @property
    def config_digest(self) -> str:
        return config_digest(self.experiment.ds_config)

    def to_dict(self) -> dict[str, Any]:
        """The content of ``exp.json``, its ``record_version`` and ``record_digest`` last."""
        data = self.experiment.to_json()
        data.update(config_digest=self.config_digest, resume_key=self.resume_key,
                    resume_context=self.resume_context, recorded_at=self.recorded_at, record_version=RECORD_VERSION)
        data["record_digest"] = record_digest(data)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExpRecord:
        """The record from a decoded ``exp.json``, verified.

        Raises:
            RecordError: another (or no) schema version, content that does not match its ``record_digest``, a
                ``ds_config`` that does not match its ``config_digest``, or a field not as zerotune writes it.
        """
        if data.get("record_version") != RECORD_VERSION:
            raise RecordError(f"record version {data.get('record_version')!r}, not this zerotune's {RECORD_VERSION}")
        if data.get("record_digest") != record_digest(data):
            raise RecordError("its content does not match its record_digest (edited or damaged)")
        if not isinstance(data.get("ds_config"), dict) or data.get("config_digest") != config_digest(data["ds_config"]):
            raise RecordError("its ds_config does not match its config_digest (edited)")
        wrong = _wrong_field(data)
        if wrong:
            raise RecordError(f"its fields are not an experiment's: {wrong}")
        return cls(Experiment.from_json(data), data["resume_key"], data["resume_context"], data["recorded_at"])


_FIELD_TYPES = {"name": str, "metrics": dict, "knobs": dict, "resume_key": str, "resume_context": dict,
                "recorded_at": str}
_FIELD_DEFAULTS = {"metrics": {}, "knobs": {}}  # an experiment's, where its record has none


def _wrong_field(data: Mapping[str, Any]) -> str:
    """The first field of a record that is not as zerotune writes it, named with why ('' when none)."""
    for key, kind in _FIELD_TYPES.items():
        if not isinstance(data.get(key, _FIELD_DEFAULTS.get(key)), kind):
            return f"'{key}' is not a JSON {'object' if kind is dict else 'string'}"
    if data.get("status") and not _member(Status, data["status"]):
        return f"'status' {data['status']!r} is not an experiment's status"
    if not _member(ExperimentKind, data.get("kind", ExperimentKind.MBS.value)):
        return f"'kind' {data.get('kind')!r} is not an experiment's kind"
    metric = data.get("metric")
    if metric is not None and (not isinstance(metric, (int, float)) or isinstance(metric, bool)):
        return f"'metric' {metric!r} is not a number"
    return ""


def _member(enum_type: type, value: Any) -> bool:
    try:
        enum_type(value)
    except (ValueError, TypeError):
        return False
    return True


def write_record(exp: Experiment, exp_dir: Path, key: str = "", context: dict[str, Any] | None = None) -> None:
    """Write ``exp_dir``'s ``exp.json`` atomically: ``exp``'s `ExpRecord` with resume ``key`` and ``context``,
    recorded now."""
    record = ExpRecord(exp, key, context or {}, time.strftime("%Y-%m-%dT%H:%M:%S"))
    write_json_atomic(Path(exp_dir) / RECORD_FILE, record.to_dict())


def load_record(exp_dir: Path, ds_config: dict, key: str = "") -> Experiment | None:
    """The reusable experiment recorded in ``exp_dir`` for this config content and resume key, if any.

    Returns:
        The recorded experiment when ``exp.json`` verifies (else logged), its config digest is ``ds_config``'s, its
        ``resume_key`` is ``key`` and its outcome is reusable (`Status.reusable`: OK or OOM); None otherwise, so the
        experiment is run again.
    """
    path = Path(exp_dir) / RECORD_FILE
    data, why = (None, "a symlink") if path.is_symlink() else read_object(path)
    record = None
    if data is not None:
        try:
            record = ExpRecord.from_dict(data)
        except RecordError as e:
            why = str(e)
    if why:
        logger.warning(f"{path}: {why}: not trusted, the experiment runs again")
        return None
    if record is None or record.config_digest != config_digest(ds_config) or record.resume_key != key:
        return None
    done = record.experiment
    return done if done.status is not None and done.status.reusable else None


def load_records(exps_dir: Path) -> list[ExpRecord]:
    """The verified records of the experiment directories directly under ``exps_dir`` that name their own directory,
    in name order."""

    exps_dir = Path(exps_dir)
    if not exps_dir.is_dir():
        return []
    records = []
    for path in sorted(exps_dir.glob(f"*/{RECORD_FILE}")):
        data = read_json(path)
        try:
            record = ExpRecord.from_dict(data) if data is not None else None
        except RecordError:
            continue
        if record is not None and record.experiment.name == path.parent.name:
            records.append(record)
    return records
