"""Memory sizes at the edge: parsing what people type (``3GiB``) and formatting bytes for people.

Inside zerotune memory is bytes (int) everywhere; these two functions are the only conversions.
"""
from __future__ import annotations

import math
import re

from zerotune.core.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, what: str = "--device-memory") -> int:
    """Parse a memory size: ``3GiB``, ``2.5GB``, ``512MiB``, ``3000000000`` -> bytes (int).

    Raises:
        ConfigError: naming ``what`` and the value when it is not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{what} = {text!r}: expected a size such as 3GiB, 2.5GB, 512MiB or a byte count")
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number >= 2**63:  # 1e400 is inf; RLIMIT_DATA takes 64 bits
            raise ConfigError(f"{what} = {text!r}: too large (at most {2**63 - 1} bytes)")
        value = int(number)
    if value <= 0:
        raise ConfigError(f"{what} = {text!r}: must be positive")
    return value


def format_bytes(n: float) -> str:
    """Bytes for people: ``2.00 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
