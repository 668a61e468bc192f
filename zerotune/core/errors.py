"""Errors zerotune reports to the user.

``ConfigError`` is bad input (a config file, a key, a value, a hostfile line): the CLI prints its
message and exits with status 2. Messages name the file, key or value and what was expected.
"""


class ConfigError(ValueError):
    """Bad user input; the message names the file, key or value and what was expected."""


class RecordError(ValueError):
    """A record on disk that is not as zerotune wrote it; the message says why, and its reader names the file."""


class TuningFailed(RuntimeError):
    """No experiment succeeded, so there is no optimal configuration to report."""
