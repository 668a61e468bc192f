"""Device slots: which exist (hostfile, ``--include``/``--exclude``, ``--num_nodes``/``--num_gpus``).
Who holds them (``SlotPool``) is `zerotune.run.slots`, importable from here too.

A *slot* is one device on one host, named by its real device id (the id the ``deepspeed`` launcher puts into
``CUDA_VISIBLE_DEVICES`` on that host; on CPU, one rank). `select_resources` resolves the arguments as the launcher
does (``deepspeed/launcher/runner.py``), but stricter: bad input raises ``ConfigError`` where the launcher falls back
or uses less than asked (a missing hostfile, ``slots=0``, ``slots=8x``, counts above what the hosts hold).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from zerotune.core.arguments import MAX_COUNT
from zerotune.core.errors import ConfigError
from zerotune.core.launch import Node
from zerotune.run.slots import LOCALHOST, SlotPool

__all__ = [
    "LOCALHOST",
    "SlotPool",
    "parse_hostfile",
    "select_resources",
    "slots_named",
]

# DeepSpeed's prefix pattern ``^(\S+)\s+slots=(\d+)``, so extra tokens after the count are accepted (MPI hostfiles),
# but the count must end at whitespace (``slots=8x`` is an error); a sign is captured for a "must be positive" message.
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=([+-]?\d+)(?:\s|$)")


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """Read a DeepSpeed hostfile (``worker-0 slots=8`` per line, ``#`` comments) into ordered ``{host: slot count}``.

    A host with ``slots=N`` has device ids ``0..N-1``.

    Raises:
        ConfigError: the file is missing or unreadable; a line is malformed, has ``slots`` below 1 or repeats a host
            (names the file, line number and text); the file lists no host.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"hostfile {path} cannot be read: {e}") from None

    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {lineno} ({raw.strip()!r})"
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ConfigError(f"{where}: expected 'HOSTNAME slots=N', e.g. 'worker-0 slots=8'")
        host, count = match.group(1), int(match.group(2))
        if not 1 <= count <= MAX_COUNT:
            raise ConfigError(f"{where}: slots must be a positive integer of at most {MAX_COUNT}, got {count}")
        if host in hosts:
            raise ConfigError(
                f"{where}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "list each host once"
            )
        hosts[host] = count
        first_line[host] = lineno
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts; expected lines like 'worker-0 slots=8'")
    return hosts


def _parse_filter(flag: str, value: str) -> dict[str, list[int]]:
    """Parse ``NAME[:SLOT[,SLOT...]][@NAME...]`` like the launcher's ``parse_node_config_list``.

    Returns ordered ``{host: sorted unique slots}``, ``[]`` for the whole host; a host named twice has its slot lists
    merged (a bare mention merged with slots leaves just the slots, as in DeepSpeed).
    """
    specs: dict[str, list[int]] = {}
    for spec in value.split("@"):
        host, sep, slot_text = spec.partition(":")
        if not host or ":" in slot_text:
            raise ConfigError(
                f"{flag} {value!r}: bad node spec {spec!r}; expected NAME or NAME:SLOT[,SLOT...], "
                "with specs joined by '@', e.g. 'worker-0:0,1@worker-1'"
            )
        slots: list[int] = []
        if sep:
            for item in slot_text.split(","):
                try:
                    slots.append(int(item))
                except ValueError:
                    raise ConfigError(
                        f"{flag} {value!r}: slot {item!r} on host {host!r} is not a device id "
                        "(expected integers like 'worker-0:0,1')"
                    ) from None
        specs.setdefault(host, []).extend(slots)
    return {h: sorted(set(s)) for h, s in specs.items()}


def slots_named(include: str) -> int:
    """Without a hostfile on CPU: the local slots ``--include`` needs (highest slot id + 1; 1 for hosts only).

    Raises:
        ConfigError: a malformed ``--include`` (``localhost:a``, ``localhost:0,,1``), naming it.
    """
    ids = [s for slots in _parse_filter("--include", include).values() for s in slots]
    if any(s < 0 for s in ids):
        raise ConfigError(f"--include {include!r}: device ids are non-negative integers")
    return max(ids) + 1 if ids else 1


def _apply_filter(available: dict[str, list[int]], include: str, exclude: str,
                  origin: str = "") -> dict[str, list[int]]:
    """The launcher's ``parse_resource_filter``: keep or drop hosts and slots, in host order; ``origin`` (where the
    slots came from) goes into the message naming an unknown slot."""
    flag, value = ("--include", include) if include else ("--exclude", exclude)
    requested = _parse_filter(flag, value)
    for host, slots in requested.items():
        if host not in available:
            known = ", ".join(available)
            raise ConfigError(f"{flag} {value!r}: host {host!r} is not among the hosts ({known})")
        missing = [s for s in slots if s not in available[host]]
        if missing:
            have = ",".join(str(s) for s in available[host])
            raise ConfigError(
                f"{flag} {value!r}: host {host!r} has no slot {missing[0]} (its slots: {have}{origin})"
            )
    if include:
        kept = {h: (requested[h] or available[h]) for h in available if h in requested}
    else:
        kept = {}
        for host, slots in available.items():
            dropped = requested.get(host)
            if dropped is None:
                kept[host] = slots
            elif dropped:  # a bare host name drops the whole host
                kept[host] = [s for s in slots if s not in dropped]
    kept = {h: s for h, s in kept.items() if s}
    if not kept:
        raise ConfigError(f"{flag} {value!r} leaves no device slots to run on")
    return kept


def _local_slots() -> tuple[list[int], str]:
    """Local CUDA device ids, as the launcher sees them, and where they came from (for messages, or "").

    A ``CUDA_VISIBLE_DEVICES`` integer list gives the real ids, not ``0..count-1``: the launcher sets the variable
    itself for each rank.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        try:
            return sorted(set(int(v) for v in visible.split(","))), f", from CUDA_VISIBLE_DEVICES={visible}"
        except ValueError:
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={visible!r} is not a list of device ids; give the devices "
                "with --include localhost:0,1 instead"
            ) from None
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    if count < 1:
        raise ConfigError(
            "no CUDA device found and no hostfile given: pass --num_gpus N "
            "(on CPU, the number of ranks to run)"
        )
    return list(range(count)), ""


def select_resources(
    hostfile: str | Path | None = None,
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
    local_slots: int | None = None,
) -> list[Node]:
    """Resolve the launcher-style resource arguments into the nodes and device slots to tune on.

    Applied in the launcher's order: hostfile (or localhost) -> ``--include``/``--exclude`` ->
    ``--num_nodes`` (first N hosts) -> ``--num_gpus`` (first N slots of each host).

    Without a hostfile on CUDA, ``CUDA_VISIBLE_DEVICES`` (integer ids) is the set of local slots by physical id,
    whatever else is given: with ``2,3,5``, ``--include localhost:3,5`` keeps 3 and 5, ``--include localhost:1`` is
    an error, ``--num_gpus 2`` keeps 2 and 3; DeepSpeed's runner would instead ignore it and run on a hidden device
    (D300). With a hostfile the slots are the hostfile's on every node, ``localhost`` included.

    Args:
        hostfile: DeepSpeed hostfile; ``None`` for a single ``localhost`` node.
        include: ``NAME[:SLOT[,SLOT...]][@NAME...]``, e.g. ``worker-0:0,1@worker-1``: only these hosts/slots
            (a bare host name means all its slots).
        exclude: same syntax: everything but these; a host left with no slot is dropped.
        num_nodes, num_gpus: keep the first N hosts / first N slots of each host; -1 for all.
        local_slots: without a hostfile, the number of local slots (ids ``0..N-1``): the CUDA device count, or on CPU
            the number of ranks. ``None`` detects CUDA devices.

    Returns:
        Nodes in hostfile order with their real device ids (``--include worker-0:4,5`` ->
        ``[Node("worker-0", (4, 5))]``).

    Raises:
        ConfigError: bad hostfile; both include and exclude; ``--num_nodes``/``--num_gpus`` not positive or given
            with include/exclude (as the launcher refuses); an unknown host or slot in include/exclude (naming
            ``CUDA_VISIBLE_DEVICES`` when it hides the device); nothing left to run on; ``--num_nodes`` above the host
            count (above 1 without a hostfile); ``--num_gpus`` above a host's slot count; no hostfile, no
            ``local_slots`` and no CUDA device.
    """

    if include and exclude:
        raise ConfigError(
            f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; give one"
        )
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus", num_gpus)):
        if value != -1 and value < 1:
            raise ConfigError(f"{flag} must be a positive integer (or -1 for all), got {value}")
        if value != -1 and (include or exclude):
            which = f"--include {include!r}" if include else f"--exclude {exclude!r}"
            raise ConfigError(
                f"{flag} cannot be combined with {which}, as in the deepspeed launcher; "
                "name the slots in the include/exclude string instead"
            )

    origin = ""
    if hostfile is not None:
        available = {h: list(range(n)) for h, n in parse_hostfile(hostfile).items()}
        source = f"hostfile {hostfile}"
    else:
        if local_slots is None:
            slots, origin = _local_slots()
        elif local_slots < 1:
            raise ConfigError(f"the number of local device slots must be positive, got {local_slots}")
        else:
            slots = list(range(local_slots))
        available = {LOCALHOST: slots}
        source = "no hostfile (localhost only)"

    if include or exclude:
        available = _apply_filter(available, include, exclude, origin)

    if num_nodes != -1:
        if num_nodes > len(available):
            need = "" if hostfile is not None else "; give a --hostfile for more than one node"
            raise ConfigError(
                f"--num_nodes {num_nodes} but {source} has {len(available)} node(s){need}"
            )
        available = dict(list(available.items())[:num_nodes])

    if num_gpus != -1:
        for host, slots in available.items():
            if num_gpus > len(slots):
                raise ConfigError(
                    f"--num_gpus {num_gpus} but host {host!r} has {len(slots)} slot(s) ({source}{origin})"
                )
        available = {h: s[:num_gpus] for h, s in available.items()}

    return [Node(h, tuple(s)) for h, s in available.items()]
