"""Warm launches: ranks forked from a server that imported torch, DeepSpeed and the script's imports once per tuning.

A cold launch pays Python's start-up in every experiment. A warm one forks its ranks from a server
(`zerotune.run.warm.server`), gives them the launcher's contract without an exec (`zerotune.run.warm.rank`) and runs
the script as ``__main__``; the tuner sees one process group, as for a cold launcher (`zerotune.run.warm.client`).
Preloading and fork-safety: `zerotune.run.warm.preload`. See D303.
"""
