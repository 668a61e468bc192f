"""Run as a script (``python -m tests.helpers.cut_measure JOBS OUT``): for each job of the JSON list in JOBS,
``[config name, attention, seq_len]`` (tests/data/hf_configs), the bytes one sample's real CPU forward of a 1-layer
and a 2-layer cut of the config saves at ``seq_len`` tokens (each storage autograd keeps, once; parameters and
buffers never), and how many layers the config has, as JSON in OUT: ``{"NAME-ATTENTION": [first, second, layers]}``.

Each cut runs at 4, 8 and 12 tokens, weights allocated and never written (pages the kernel never backs), and the
exact quadratic through the three counts gives the value at ``seq_len`` (saved bytes are ``c + a*s + b*s^2`` in the
sequence length: the ``s^2`` are the scores eager attention keeps). A separate process: the CPU allocator keeps the
cuts' address space (about 18 GiB for Llama-3-70B's), which would make a test worker's later forks fail.
"""
import json
import sys
from fractions import Fraction

import torch

from tests.helpers.hf_configs import read
from zerotune.model import fake_forward

SEQ_LENS = (4, 8, 12)


def cut(cfg: dict, layers: int) -> tuple[dict, int]:
    """``cfg`` with its (language model's) decoder cut to ``layers`` layers, and how many it had; lists of one
    entry per layer (``layer_types``) cut with it."""
    vlm = isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg
    text = dict(cfg["text_config"] if vlm else cfg)
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in text), "num_hidden_layers")
    had = text.get(key) or 32  # LLaVA's text_config leaves LlamaConfig's default
    text = {k: v[:layers] if isinstance(v, list) and len(v) == had else v for k, v in text.items()}
    text[key] = layers
    return ({**cfg, "text_config": text} if vlm else text), had


def measured(cfg: dict, attention: str, seq_len: int) -> int:
    """Bytes one sample's real CPU forward of ``cfg`` saves at ``seq_len`` tokens, interpolated exactly from
    :data:`SEQ_LENS`."""
    with torch.device("meta"):
        try:
            model = fake_forward._model(cfg, fake_forward.KERNELS[attention], torch.bfloat16)
        except ValueError:  # Gemma 2 runs no SDPA: eager, as the count says
            model = fake_forward._model(cfg, "eager", torch.bfloat16)
    model = model.to_empty(device="cpu").train()
    counts = [fake_forward._saved(model, torch, s)[0] for s in SEQ_LENS]
    value = Fraction(0)
    for i, (xi, yi) in enumerate(zip(SEQ_LENS, counts)):
        term = Fraction(yi)
        for j, xj in enumerate(SEQ_LENS):
            if j != i:
                term *= Fraction(seq_len - xj, xi - xj)
        value += term
    return int(value)


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    out = {}
    for name, attention, seq_len in jobs:
        cfg = read(name)
        (one, layers), (two, _) = cut(cfg, 1), cut(cfg, 2)
        out[f"{name}-{attention}"] = [measured(one, attention, seq_len), measured(two, attention, seq_len), layers]
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
