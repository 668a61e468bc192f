"""Reading the files a user names: the ds_config, a hostfile, a Hugging Face ``config.json``, a profile's
``model_info.json``, DeepSpeed's env file (D304).

One rule for every such reader: the file is a regular file (not a directory, a FIFO, a device such as ``/dev/zero``,
a socket) of at most `MAX_FILE_BYTES`, its text is UTF-8, and its JSON nests at most `MAX_JSON_DEPTH` deep. Anything
else, and any error reading it, is a `zerotune.core.errors.ConfigError` (exit status 2), never a traceback, a
``MemoryError`` or a read that never ends. Its message reads ``"{label}: {what is wrong}; {rule}"``: ``label`` names
the file (``--hf-config config.json``), ``rule`` says what such a file is (``"a DeepSpeed config is UTF-8 JSON"``).
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.core.units import format_bytes

__all__ = ["MAX_FILE_BYTES", "MAX_JSON_DEPTH", "JSONTooDeep", "check_file", "file_in", "json_depth", "load_json",
           "load_object", "loads", "read_text"]

MAX_FILE_BYTES = 4 * 2**20
"""The largest file read, bytes (4 MiB): a ds_config or a hostfile is a few KiB, a Hugging Face ``config.json``
KiB too, about a MiB where it lists thousands of labels; a larger file is a mistake (a dataset, a checkpoint), and
reading it whole could take all of memory."""

MAX_JSON_DEPTH = 64
"""The deepest nesting of JSON arrays and objects read (a ds_config nests 4 deep): Python's JSON parser, and
the copies and walks of a config after it, recurse once or more per level, and Python stops at 1000 frames."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_TOO_DEEP = f"JSON nested deeper than the {MAX_JSON_DEPTH} levels zerotune reads"


class JSONTooDeep(ValueError):
    """JSON that nests deeper than `MAX_JSON_DEPTH` (raised by `loads`)."""


class DuplicateKey(Exception):
    """A JSON object that names one key twice (raised by `loads`): ``json`` would keep the last silently, and
    DeepSpeed refuses such a config (``deepspeed/runtime/config_utils.py``, ``dict_raise_error_on_duplicate_keys``)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen[key] = value
    return seen


def _check_stat(st: os.stat_result, label: str, rule: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
        raise ConfigError(f"{label}: {kind}, not a regular file; {rule}")
    if st.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{label}: {st.st_size} bytes, more than the {format_bytes(MAX_FILE_BYTES)} zerotune "
                          f"reads; {rule}")


def _unreadable(label: str, rule: str, error: OSError | ValueError) -> ConfigError:
    return ConfigError(f"{label}: cannot read it ({getattr(error, 'strerror', None) or error}); {rule}")


def check_file(path: str | Path, label: str, rule: str) -> None:
    """Check, without opening it, that ``path`` is a regular file of at most `MAX_FILE_BYTES` (for a reader that
    opens it itself); a missing path passes (the reader names it).

    Raises:
        ConfigError: not a regular file (``"{label}: a FIFO (named pipe), not a regular file; {rule}"``), too large,
            or ``stat`` fails otherwise.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:  # ValueError: a NUL character in the path
        raise _unreadable(label, rule, e) from None
    _check_stat(st, label, rule)


def file_in(path: str | Path, name: str, option: str) -> tuple[Path, str]:
    """The file a path option (``option``, e.g. ``--hf-config``) names: ``path``, or its file ``name`` when ``path``
    is a directory; and the label messages name it by (``"--hf-config DIR: config.json"``, ``"--hf-config FILE"``)."""
    p = Path(path)
    if p.is_dir():
        return p / name, f"{option} {path}: {name}"
    return p, f"{option} {path}"


def _read_bytes(path: str | Path, label: str, rule: str) -> bytes:
    """At most `MAX_FILE_BYTES` of a regular file: its kind checked before it is opened (a socket cannot be),
    and again once open, opened without blocking (a FIFO put in its place meanwhile)."""
    check_file(path, label, rule)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _unreadable(label, rule, e) from None
    try:
        _check_stat(os.fstat(fd), label, rule)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)  # the file may have grown since fstat
    except OSError as e:
        raise _unreadable(label, rule, e) from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{label}: more than the {format_bytes(MAX_FILE_BYTES)} zerotune reads; {rule}")
    return data


def read_text(path: str | Path, label: str, rule: str) -> str:
    """The UTF-8 text of the file at ``path``, read by the module's rule.

    Raises:
        ConfigError: naming ``label``: it cannot be opened or read (missing, a permission), it is not a regular
            file, it is larger than `MAX_FILE_BYTES`, or it is not UTF-8 (the first bad byte and its offset).
    """
    data = _read_bytes(path, label, rule)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{label}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); {rule}") from None


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How many arrays and objects deep ``value`` nests (a scalar: 0, ``{"a": []}``: 2), walked without recursion;
    counting stops once past ``limit`` (the result is then ``limit + 1``)."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def loads(text: str) -> Any:
    """``json.loads``, nesting bounded.

    Raises:
        JSONTooDeep: the JSON nests deeper than `MAX_JSON_DEPTH` (or so deep that the parser recursed out).
        json.JSONDecodeError: invalid JSON.
        DuplicateKey: an object names a key twice.
        ValueError: a number Python does not convert (an integer of more than 4300 digits).
    """
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise JSONTooDeep(_TOO_DEEP) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise JSONTooDeep(_TOO_DEEP)
    return value


def load_json(path: str | Path, label: str, rule: str) -> Any:
    """The JSON value of the file at ``path``, read by the module's rule.

    Raises:
        ConfigError: as `read_text`; invalid JSON (``"{label}:{line}:{column}: invalid JSON: ..."``), a number
            Python does not convert, nesting deeper than `MAX_JSON_DEPTH`, or a key named twice in one object.
    """
    text = read_text(path, label, rule)
    try:
        return loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{label}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}; {rule}") from None
    except JSONTooDeep as e:
        raise ConfigError(f"{label}: {e}; {rule}") from None
    except DuplicateKey as e:
        raise ConfigError(f"{label}: the key {str(e)!r} appears twice in one object (JSON would keep the last "
                          f"without a word; DeepSpeed refuses the file); {rule}") from None
    except ValueError:  # int() refuses the digits
        raise ConfigError(f"{label}: a JSON number of more than {sys.get_int_max_str_digits()} digits; {rule}") \
            from None


_JSON_TYPES = ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"))


def load_object(path: str | Path, label: str, rule: str) -> dict[str, Any]:
    """The JSON object of the file at ``path``, read by the module's rule.

    Raises:
        ConfigError: as `load_json`, or the JSON is not an object (``"{label}: a JSON array, not an object; ..."``).
    """
    value = load_json(path, label, rule)
    if not isinstance(value, dict):
        kind = "null" if value is None else next(name for t, name in _JSON_TYPES if isinstance(value, t))
        raise ConfigError(f"{label}: a JSON {kind}, not an object; {rule}")
    return value
