"""Run as a script (``python -m tests.helpers.cut_measure JOBS OUT``): for each job of the JSON list in JOBS,
``[config name, attention, seq_len]`` (tests/data/hf_configs), the bytes one sample's real CPU forward of a 1-layer
and a 2-layer cut of the config saves at ``seq_len`` tokens (each storage autograd keeps, once; parameters and
buffers never), and how many layers the config has, as JSON in OUT: ``{"NAME-ATTENTION": [first, second, layers]}``.
``--record`` measures every published config (:func:`jobs`) into :data:`RECORD`, with the torch and transformers
versions it ran on (about 4 minutes).

Each cut runs at 4, 8 and 12 tokens, weights allocated and never written (pages the kernel never backs), and the
exact quadratic through the three counts gives the value at ``seq_len`` (saved bytes are ``c + a*s + b*s^2`` in the
sequence length: the ``s^2`` are the scores eager attention keeps). A separate process: the CPU allocator keeps the
cuts' address space (about 18 GiB for Llama-3-70B's), which would make a test worker's later forks fail.
"""
import json
import sys
from fractions import Fraction
from pathlib import Path

import torch
import transformers

from tests.helpers.hf_configs import PUBLISHED, read
from zerotune.model import fake_forward

SEQ_LENS = (4, 8, 12)
RECORD = Path(__file__).parents[1] / "data" / "activation_cuts.json"


def versions() -> dict:
    """What a measurement depends on besides the configs: the installed torch and transformers."""
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def compared_tokens(name: str) -> int:
    """A published config's tokens for the comparison: 4,096, or its context where shorter (GPT-2 XL: 1,024)."""
    cfg = read(name)
    text = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    return min(4096, text.get("max_position_embeddings") or text.get("n_positions"))


def jobs(names=None) -> list[list]:
    """``[name, attention, seq_len]`` for each of ``names`` (every published config by default), eager and SDPA."""
    return [[name, attention, compared_tokens(name)] for name in sorted(names or PUBLISHED)
            for attention in ("eager", "sdpa")]


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


def measure(todo: list[list]) -> dict:
    """``{"NAME-ATTENTION": [first, second, layers]}`` for each ``[name, attention, seq_len]`` of ``todo``."""
    out = {}
    for name, attention, length in todo:
        cfg = read(name)
        (one, layers), (two, _) = cut(cfg, 1), cut(cfg, 2)
        out[f"{name}-{attention}"] = [measured(one, attention, length), measured(two, attention, length), layers]
    return out


def main() -> None:
    if sys.argv[1:] == ["--record"]:
        cuts = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in measure(jobs()).items())
        RECORD.write_text(f'{{"versions": {json.dumps(versions())},\n "cuts": {{\n{cuts}\n}}}}\n')
        return
    with open(sys.argv[2], "w") as f:
        json.dump(measure(json.loads(open(sys.argv[1]).read())), f)


if __name__ == "__main__":
    main()
