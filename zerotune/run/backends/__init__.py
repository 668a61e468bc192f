"""Backends run one experiment on reserved slots: ``local`` (the deepspeed launcher as a subprocess)."""
