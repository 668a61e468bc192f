"""Errors zerotune reports to the user; the CLI prints a `ConfigError`'s message and exits with status 2."""


class ConfigError(ValueError):
    """Bad user input (a config file, a key, a value, a hostfile line); the message names it and what was expected."""


class RecordError(ValueError):
    """A record on disk that is not as zerotune wrote it; the message says why, and its reader names the file."""


class TuningFailed(RuntimeError):
    """No experiment succeeded, so there is no optimal configuration to report."""
