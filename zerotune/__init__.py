"""zerotune: find the fastest DeepSpeed configuration for a model and cluster.

The package is laid out as the data flow (see ARCHITECTURE.md): ``config`` -> ``resources`` ->
``profile`` -> ``memory`` -> ``search`` (with ``space`` and ``tuners``) -> ``scheduler`` ->
``backends`` -> ``results``. ``autotuner.Autotuner`` ties them together; ``cli`` is the
launcher-style command line.
"""

__version__ = "0.1.0"
