"""zerotune: find the fastest DeepSpeed configuration for a model and cluster.

The packages follow the data flow (the README's "How it works" draws it): ``core`` (the
experiment record, the objective, errors, units) and ``deepspeed`` (DeepSpeed's config, keys,
defaults, canonical names, validation, experiment directory, launcher) are the ground floor;
``strategy`` turns a :class:`~zerotune.strategy.job.Job` into experiments (config builder, ZeRO
stages, mbs search, knob spaces, tuners) using ``model`` (memory model, profile); ``run``
schedules and runs them (slots, scheduler, processes, backends); ``report`` writes the answer.
``autotuner.Autotuner`` is the Python API, ``cli`` the launcher-style command line.
"""

__version__ = "0.1.0"
