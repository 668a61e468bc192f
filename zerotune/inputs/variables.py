"""``$VAR`` templates in the user's ds_config, and the variables that resolve them.

Placeholders follow `zerotune.inputs.placeholders` (as the whole value, an int stays an int). Candidates come from
``"autotuning": {"variables": {"NAME": [...]}}`` or ``--var NAME=VALUE`` (`parse_cli_variable`), the command line
winning. A variable is a tuning dimension like a list of candidates at a key: the profile run and the mbs search take
its first candidate (`first_values`), the knob phase (``"fast": false``) tries each. Placeholders at the keys zerotune
searches itself (`SEARCHED_KEYS`) are refused.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from zerotune.core import user_files
from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import GAS, MBS, TBS, ZERO
from zerotune.inputs.placeholders import PLACEHOLDER, replace_placeholders

__all__ = ["first_values", "parse_cli_variable", "parse_variables", "placeholder_paths", "substitute"]

SEARCHED_KEYS = (MBS, GAS, TBS, f"{ZERO}.stage")
"""Keys zerotune searches itself: a placeholder there is refused."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def placeholder_paths(config: Any, path: str = "") -> dict[str, list[str]]:
    """Variable name -> the dotted keys whose value holds its placeholder (an item of a list counts as
    its key), in the config's order; the ``autotuning`` section aside."""
    out: dict[str, list[str]] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, str):
            for m in PLACEHOLDER.finditer(value):
                name = m.group(2) or m.group(3)
                if name and where not in out.setdefault(name, []):
                    out[name].append(where)
        elif isinstance(value, dict):
            for k, v in value.items():
                if where or k != "autotuning":
                    walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(value, list):
            for v in value:
                walk(v, where)

    walk(config, path)
    return out


def parse_variables(given: Mapping[str, Any] | None, config: Mapping[str, Any],
                    source: str = "ds_config") -> dict[str, list[Any]]:
    """Name (no ``$``) -> candidates (a non-empty list) of ``given`` (``autotuning.variables`` updated with ``--var``:
    a name with or without ``$`` -> a list of candidates or one value), checked against the config's placeholders.

    Raises:
        ConfigError: naming ``source`` and the variable or key: a placeholder no variable gives, a variable no
            placeholder uses, a bad name, an empty list, a placeholder at a key zerotune searches itself.
    """
    variables: dict[str, list[Any]] = {}
    for name, values in (given or {}).items():
        bare = name[1:] if name.startswith("$") else name
        if not _NAME.fullmatch(bare):
            raise ConfigError(f"{source}: variable {name!r}: expected a name of letters, digits and _")
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ConfigError(f"{source}: variable ${bare} = []: expected at least one candidate")
        variables[bare] = values
    used = placeholder_paths(config)
    for name, paths in used.items():
        searched = [p for p in paths if p in SEARCHED_KEYS]
        if searched:
            raise ConfigError(f"{source}: '{searched[0]}' holds the placeholder ${name}: zerotune searches "
                              f"{searched[0]} itself; give a value or a list of candidates")
        if name not in variables:
            raise ConfigError(f"{source}: '{paths[0]}' holds the placeholder ${name}, which no variable gives: set "
                              f"\"autotuning\": {{\"variables\": {{\"{name}\": [...]}}}} or pass --var {name}=VALUE "
                              f"(or write $$ for a literal $)")
    for name in variables:
        if name not in used:
            raise ConfigError(f"{source}: variable ${name} is used by no $-placeholder in the config")
    return variables


def parse_cli_variable(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` from ``--var``: VALUE as JSON (``[5e7, 5e8]``, ``4``, ``true``), else the text.

    Raises:
        ConfigError: no ``=``, an empty name, or a VALUE that is JSON nested deeper than
            `zerotune.core.user_files.MAX_JSON_DEPTH` levels (the message shows its first 40 characters).
    """
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"--var {text!r}: expected NAME=VALUE, e.g. --var RBS='[5e7, 5e8]'")
    try:
        return name, user_files.loads(value)
    except user_files.JSONTooDeep as e:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ConfigError(f"--var {shown!r}: VALUE is {e}; expected JSON (a list of candidates) or text") from None
    except ValueError:
        return name, value


def first_values(variables: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Each variable's first candidate (the profile run's and the micro-batch search's value)."""
    return {name: values[0] for name, values in variables.items()}


def substitute(config: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with each placeholder replaced by its variable's value in ``values``
    (``config`` itself when there are none); the ``autotuning`` section is left as it is."""
    if not values:
        return config
    return {k: v if k == "autotuning" else replace_placeholders(v, dict(values)) for k, v in config.items()}
