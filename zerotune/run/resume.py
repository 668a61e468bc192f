"""The resume key: when a result on disk answers for an experiment of this job.

A rerun reuses a recorded outcome only for the same experiment, not merely the same ds_config: the key covers the
ds_config's content, the script's resolved path and content, its arguments, the world layout, the per-device memory
budget and how the result is measured (`resume_context`). Other files (imported modules, data) are not read: start
fresh (``--overwrite``) when they change. Only outcomes that are a property of the experiment are reused
(`zerotune.core.experiment.Status.reusable`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from zerotune.core.objective import Objective
from zerotune.core.stopping import StopRule
from zerotune.deepspeed.canonical import config_hash
from zerotune.deepspeed.config import AutotuningConfig

CONFIG_PLACEHOLDER = "<ds_config>"  # stands for the ds_config path in the keyed script arguments


class ResumedJob(Protocol):
    """The fields of `zerotune.inputs.job.Job` that `resume_context` keys on (a protocol: this layer names no
    strategy type)."""

    script: str
    script_args: Sequence[str]
    num_nodes: int
    slots_per_node: int
    mp_size: int
    cpu: bool
    device_memory_bytes: int
    autotuning: AutotuningConfig
    objective: Objective
    stop_rule: StopRule | None
    arg_mappings: Mapping[str, str]
    launcher: Any  # zerotune.launchers.base.Launcher: name, words, script_arguments, rank_env


def resume_context(job: ResumedJob) -> dict[str, Any]:
    """Everything besides the ds_config that makes an experiment of ``job`` the same experiment.

    Returns:
        A JSON-ready dict: ``script`` (resolved path), ``script_sha256`` (None when unreadable), ``script_args`` (the
        ds_config path as `CONFIG_PLACEHOLDER`), the layout, ``device_memory_bytes``, the profile steps,
        ``objective``, ``precision`` (the adaptive stop's half-width; None without one), ``arg_mappings``,
        ``max_steps_arg`` where set, and for a launcher other than ``deepspeed``, ``launcher`` (its words and rank
        variables).
    """
    script = Path(job.script).resolve()
    launcher = job.launcher
    own = {} if launcher.name == "deepspeed" else {
        "launcher": {"words": list(launcher.words),
                     "env": {k: v for k, v in launcher.rank_env(None).items() if k != "PYTHONPATH"}}}
    return {
        **own,
        "script": str(script),
        "script_sha256": _sha256(script),
        "script_args": launcher.script_arguments(job.script_args, CONFIG_PLACEHOLDER),
        "num_nodes": job.num_nodes,
        "slots_per_node": job.slots_per_node,
        "mp_size": job.mp_size,
        "cpu": job.cpu,
        "device_memory_bytes": job.device_memory_bytes,
        "start_profile_step": job.autotuning.start_profile_step,
        "end_profile_step": job.autotuning.end_profile_step,
        "objective": job.objective.name,
        "precision": job.stop_rule.precision if job.stop_rule else None,
        "arg_mappings": dict(sorted(job.arg_mappings.items())),
        **({"max_steps_arg": job.autotuning.max_steps_arg} if job.autotuning.max_steps_arg else {}),
    }


def resume_key(ds_config: dict[str, Any], context: dict[str, Any]) -> str:
    """The experiment's identity for resume: SHA-256 (hex) of the config's
    `zerotune.deepspeed.canonical.config_hash` and the canonical JSON of ``context`` (`resume_context`)."""

    text = config_hash(ds_config) + "\n" + json.dumps(context, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
