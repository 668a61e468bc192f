"""``$NAME`` placeholders in a template config or tuning space: found, checked against the variables, replaced.

``$NAME`` or ``${NAME}``, ``$$`` for a literal ``$``; a string that is exactly one placeholder takes the value itself,
a placeholder inside a longer string takes the value's text (`zerotune.inputs.space.generate`'s ``variables``).
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.canonical import normalize

__all__ = ["PLACEHOLDER", "WHOLE_PLACEHOLDER", "check_variables", "collect_placeholders", "replace_placeholders"]

PLACEHOLDER = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
"""``$$`` (group 1), ``${NAME}`` (group 2) or ``$NAME`` (group 3) anywhere in a string."""
WHOLE_PLACEHOLDER = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
"""One placeholder, ``${NAME}`` (group 1) or ``$NAME`` (group 2), matched against a whole string."""


def collect_placeholders(value: Any, path: str, out: dict[str, str]) -> None:
    """Collect placeholder name -> first path where it occurs."""
    if isinstance(value, str):
        for m in PLACEHOLDER.finditer(value):
            name = m.group(2) or m.group(3)
            if name:
                out.setdefault(name, path)
    elif isinstance(value, dict):
        for k, v in value.items():
            collect_placeholders(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            collect_placeholders(v, f"{path}[{i}]", out)


def _text(value: Any) -> str:
    value = normalize(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


def replace_placeholders(value: Any, env: dict[str, Any]) -> Any:
    """A copy of ``value`` with each placeholder replaced by its value in ``env`` (name -> value)."""
    if isinstance(value, str):
        whole = WHOLE_PLACEHOLDER.fullmatch(value)
        if whole:
            return copy.deepcopy(env[whole.group(1) or whole.group(2)])

        def repl(m: re.Match) -> str:
            if m.group(1):
                return "$"
            return _text(env[m.group(2) or m.group(3)])

        return PLACEHOLDER.sub(repl, value)
    if isinstance(value, dict):
        return {k: replace_placeholders(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_placeholders(v, env) for v in value]
    return value


def check_variables(base: dict[str, Any], space: dict[str, Any], variables: dict[str, Any]
                    ) -> dict[str, list[Any]]:
    """The variables by their bare names (no ``$``), checked against the placeholders of the base config and space.

    Raises:
        ConfigError: a name given twice (with and without ``$``), a bad name, a value that is not a
            non-empty list, a placeholder no variable gives, a variable no placeholder uses.
    """
    env: dict[str, list[Any]] = {}
    for name, values in variables.items():
        bare = name[1:] if name.startswith("$") else name
        if bare in env:
            raise ConfigError(f"variable ${bare} is given twice (as {bare!r} and {'$' + bare!r})")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", bare):
            raise ConfigError(f"variable {name!r}: expected a name of letters, digits and _")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"variable ${bare} = {values!r}: expected a non-empty list of candidates")
        env[bare] = values
    used: dict[str, str] = {}
    collect_placeholders(base, "", used)
    collect_placeholders(space, "", used)
    for name, path in used.items():
        if name not in env:
            raise ConfigError(f"unresolved variable ${name} at {path}: give its candidates in "
                              f"variables (or write $$ for a literal $)")
    for name in env:
        if name not in used:
            raise ConfigError(f"variable ${name} is not used by any $-placeholder in the config or "
                              f"the tuning space")
    return env
