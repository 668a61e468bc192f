"""Stop handles: what a running record names besides processes, so a later tuner can stop a run its dead tuner
held outside this machine's processes.

A handle is a JSON object with a ``kind``, stopped by that kind's canceller (`CANCELLERS`): ``slurm_step``
(`zerotune.run.backends.slurm_step`) or ``warm_socket_dir`` (`socket_dir_handle`). The local backend's runs have
none.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zerotune.run.backends.slurm_step import STOP_KIND, cancel_step_handle

__all__ = ["CANCELLERS", "cancel_handle", "record_handle", "remove_socket_dir", "socket_dir_handle"]

SOCKET_DIR_KIND = "warm_socket_dir"
SOCKET_DIR_PREFIX = "zerotune-warm-"


def socket_dir_handle(path: Path) -> dict[str, str]:
    """The handle of a warm server's socket directory ``path`` (``<temp dir>/zerotune-warm-*``)."""
    return {"kind": SOCKET_DIR_KIND, "path": str(path)}


def remove_socket_dir(handle: Mapping[str, Any]) -> bool:
    """Remove the directory a `socket_dir_handle` names, only if directly in the temp dir and named
    ``zerotune-warm-*``; returns whether it is gone."""
    path = Path(str(handle.get("path", "")))
    if path.parent != Path(tempfile.gettempdir()) or not path.name.startswith(SOCKET_DIR_PREFIX):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


CANCELLERS: dict[str, Callable[[Mapping[str, Any]], bool]] = {STOP_KIND: cancel_step_handle,
                                                              SOCKET_DIR_KIND: remove_socket_dir}
"""Each handle kind's canceller: it stops what the handle names and returns whether it is gone."""


def record_handle(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The stop handle of a running record: its ``stop`` object; None when it has none."""
    handle = record.get("stop")
    return handle if isinstance(handle, Mapping) else None


def cancel_handle(handle: Mapping[str, Any] | None) -> bool:
    """Stop what ``handle`` names; returns whether it is gone (False for no handle or an unknown kind)."""

    kind = handle.get("kind") if handle is not None else None
    canceller = CANCELLERS.get(kind) if isinstance(kind, str) else None
    return canceller(handle) if canceller is not None else False
