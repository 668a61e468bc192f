"""zerotune's step probe: one JSON line per optimizer step, in every rank, with no change to the script.

The launch puts this directory first on the ranks' ``PYTHONPATH`` and sets ``PYTHON_ZEROTUNE_PROBE_DIR``
(`zerotune.deepspeed.launcher.launch_env`): ``site`` imports this file in every process, which installs the probe
where that variable is set (`install`), then always runs the user's own ``sitecustomize`` (`_chain`). Rules: this
directory holds only this file, ``__init__.py`` and ``_zerotune_probe`` (the probe's parts); this file and
``_zerotune_probe`` import neither zerotune nor, at start-up, anything but the standard library. The ranks import
them as ``sitecustomize`` and ``_zerotune_probe``, the tuner and a warm rank as ``zerotune.probe.sitecustomize``.
"""
import os
import sys

if __package__:  # zerotune.probe.sitecustomize
    from ._zerotune_probe import engine as _engine
    from ._zerotune_probe import padding as _padding
    from ._zerotune_probe import peak as _peak
    from ._zerotune_probe import records as _records
else:  # sitecustomize, imported by ``site`` with this directory on sys.path
    from _zerotune_probe import engine as _engine
    from _zerotune_probe import padding as _padding
    from _zerotune_probe import peak as _peak
    from _zerotune_probe import records as _records

# The name starts with PYTHON so that DeepSpeed's multi-node runner forwards it to the other nodes' ranks
# (deepspeed/launcher/runner.py EXPORT_ENVS exports variables starting with PYTHON, MLFLOW, MV2, UCX).
PROBE_DIR_ENV = "PYTHON_ZEROTUNE_PROBE_DIR"
BUDGET_ENV = _peak.BUDGET_ENV  # bytes per device, on CUDA ranks (`cap_allocator`)
PAD_FILE = _padding.PAD_FILE  # in the probe's dir: the length every micro batch is padded to (--verify-longest)
STREAM_PREFIX, STREAM_SUFFIX = _records.STREAM_PREFIX, _records.STREAM_SUFFIX
ENGINE_RECORD = _records.ENGINE_RECORD
ACTIVATIONS_RECORD = _records.ACTIVATIONS_RECORD
EXIT_PREFIX, EXIT_SUFFIX = _records.EXIT_PREFIX, _records.EXIT_SUFFIX
ENGINE_MODULE = _engine.ENGINE_MODULE
stream_name, exit_name = _records.stream_name, _records.exit_name
cap_allocator = _peak.cap_allocator
install = _engine.install


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` after this directory (the user's own)."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _main() -> None:
    directory = os.environ.get(PROBE_DIR_ENV)
    if directory:
        install(directory)
    _chain()


if __name__ == "sitecustomize":  # imported by ``site`` at start-up, not as zerotune.probe.sitecustomize
    _main()
