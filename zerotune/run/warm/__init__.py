"""Warm launches: ranks forked from a server that imported torch, DeepSpeed and the script's imports once per tuning.

A cold launch pays Python's start-up in every experiment: DeepSpeed's launcher process, each rank's imports, exit.
A warm one forks its ranks from a server that did those imports once (`zerotune.run.warm.server`), gives them
DeepSpeed's launcher contract without an exec (`zerotune.run.warm.rank`) and runs the script as ``__main__``;
the tuner sees the run as one process group, as it sees a cold launcher's (`zerotune.run.warm.client`). What
is preloaded, and why it stays fork-safe: `zerotune.run.warm.preload`. docs/decisions.md D303.
"""
