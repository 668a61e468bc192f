"""The step probe's parts, installed in every rank by ``zerotune/probe/sitecustomize.py``: the records (`.records`),
the peak memory (`.peak`), the engine's wrapping (`.engine`), what a batch held (`.batch`), the batch padded to the
longest length (`.padding`), the profile run's saved activations (`.activations`) and step growth (`.growth`).

Private, and named so that no package on the ranks' ``sys.path`` shadows it or is shadowed. Its modules import only
the standard library and each other, relatively (the ranks import it as ``_zerotune_probe``, the tuner as
``zerotune.probe._zerotune_probe``); torch and deepspeed are reached through ``sys.modules`` once the script has
imported them, zerotune never (the ranks may run another environment). No failure of the probe breaks training.
"""
