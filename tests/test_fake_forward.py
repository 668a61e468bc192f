"""Activations of published model configs (tests/data/hf_configs) as `zerotune estimate` counts them on transformers'
forward over fake CPU tensors (zerotune.model.fake_forward), against a real CPU measurement.

The measurement: the same rule (each storage autograd saves, once; parameters and buffers never) on a real forward
of a 1-layer and a 2-layer cut of the config, weights allocated and never written (pages the kernel never backs).
It runs at 8, 16 and 24 tokens, and the exact quadratic through the three counts gives its value at 4,096 tokens
(saved bytes are ``c + a*s + b*s^2`` in the sequence length: the ``s^2`` are the scores eager attention keeps);
the L-layer model is the 1-layer cut plus L - 1 times the second layer.
"""
from fractions import Fraction

import pytest
import torch

from tests.helpers.hf_configs import PUBLISHED, read
from zerotune.model import fake_forward
from zerotune.model.hf_config import architecture

SEQ_LENS = (8, 16, 24)


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


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_activations_at_4096_tokens_are_within_10_percent_of_a_cpu_measurement_of_a_two_layer_cut(name, attention):
    cfg = read(name)
    text = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    s = min(4096, text.get("max_position_embeddings") or text.get("n_positions"))  # GPT-2 XL: 1,024
    (one, layers), (two, _) = cut(cfg, 1), cut(cfg, 2)
    first, second = measured(one, attention, s), measured(two, attention, s)
    whole = first + (layers - 1) * (second - first)
    arch = architecture(cfg, seq_len=s, attention=attention)
    assert abs(arch.activation_bytes_per_sample / whole - 1) < 0.10, (arch.activation_bytes_per_sample, whole)
    if attention == "sdpa":  # flash is counted on CPU's flash kernel, SDPA's
        assert architecture(cfg, seq_len=s, attention="flash").activation_bytes_per_sample == \
            arch.activation_bytes_per_sample


def test_eager_attention_keeps_each_layers_scores_and_sdpa_none():
    cfg = read("llama-3-8b")
    eager, sdpa = (fake_forward.count(cfg, 4096, "bfloat16", a) for a in ("eager", "sdpa"))
    # per layer: the scores' softmax in fp32 and its bf16 copy, 32 heads x 4096^2 x (4 + 2) bytes; 32 layers; and
    # 1.5% more for the kernels' different copies of q, k, v and the output
    assert 1 < (eager.plain - sdpa.plain) / (32 * 32 * 4096 ** 2 * 6) < 1.02
    assert (eager.attention, sdpa.attention) == ("eager", "sdpa")


def test_a_model_without_sdpa_is_counted_as_eager_and_says_so():
    counted = fake_forward.count(read("gemma-2-9b"), 4096, "bfloat16", "sdpa")
    assert counted.attention == "eager"
    assert counted.note.startswith("Gemma2") and counted.note.endswith(": counted as eager")
    arch = architecture(read("gemma-2-9b"), seq_len=4096, attention="sdpa")
    assert (arch.activations_counted, counted.note in arch.notes) == ("eager", True)


def test_attention_dropout_is_not_counted_for_sdpa_and_is_for_eager():
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    dropout = fake_forward.count(gpt2, 128, "bfloat16", "sdpa")
    none = fake_forward.count({**gpt2, "attn_pdrop": 0.0}, 128, "bfloat16", "sdpa")
    assert dropout == none  # GPT2Config's attn_pdrop 0.1 would send CPU to the math kernel, which keeps the scores
    assert fake_forward.count(gpt2, 128, "bfloat16", "eager").plain > none.plain


def test_a_forward_that_fails_on_fake_tensors_is_counted_in_closed_form_and_says_so():
    # transformers runs Mixtral's experts through torch._grouped_mm, whose fake kernel takes bf16 only
    assert fake_forward.count(read("mixtral-8x7b"), 4096, "float32", "sdpa") is None
    arch = architecture(read("mixtral-8x7b"), seq_len=4096, bytes_per_activation=4, attention="sdpa")
    assert "activations by the closed form: MixtralForCausalLM's forward did not run on fake tensors" in arch.notes
    assert any(n.startswith("MoE activations: each token through 2 of 8 experts") for n in arch.notes)
