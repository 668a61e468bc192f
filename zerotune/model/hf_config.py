"""A model's size and activation memory from its Hugging Face ``config.json``, with no weights.

For decoder transformers (GPT-2, OPT, Llama, Mistral, Qwen2, ... and BERT-like encoders): the
parameter count follows from the architecture, and the activation memory per sample follows
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1,
eq. (1): a transformer layer stores ``s*h*(34 + 5*a*s/h)`` bytes per sample with 16-bit
activations (s = sequence length, h = hidden size, a = attention heads); the ``5*a*s^2`` term is the
attention scores, softmax and its dropout mask, which a fused (flash) attention does not store
(``flash_attention=True``). On top of the layers: the logits in 16 bits and their fp32 copy for
the loss, ``6*s*V`` (V = vocabulary). Of the 34: attention 11, the two layer norms 4, the MLP 19 =
2 (its input) + 1 (dropout mask) + 16 (the activation function's input and output, ``2*ffn/h`` each
at 2 bytes); with another MLP width ffn the layer stores ``s*h*(18 + 4*ffn/h)`` (34 at ffn = 4h).
A gated MLP (Llama's SwiGLU) is counted as one of width ffn, a slight underestimate. With activation
checkpointing (``checkpointing=True``, sec. 5: full recomputation) a layer keeps only its input,
``2*s*h``, and one layer's activations are live again while it is recomputed in the backward pass
(``zerotune estimate`` computes both, for the memory model's plain and checkpointed terms).
fp32 activations are twice the bytes.

Read: ``hidden_size``/``n_embd``/``d_model``, ``num_hidden_layers``/``n_layer``/``num_layers``,
``num_attention_heads``/``n_head``, ``num_key_value_heads`` (grouped-query attention),
``intermediate_size``/``n_inner``/``ffn_dim`` (default 4h), ``vocab_size``,
``max_position_embeddings``/``n_positions`` (the sequence length unless given),
``tie_word_embeddings`` (default true), ``hidden_act`` (a gated MLP for silu/swiglu: 3 matrices),
``model_type`` (learned position embeddings for gpt2/opt/bert-like; none for rotary models).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.core.errors import ConfigError

ROTARY_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox", "gptj",
                "falcon", "olmo", "olmo2", "starcoder2", "stablelm", "cohere", "deepseek_v2", "internlm2"}
RMSNORM_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "deepseek_v2",
                 "internlm2", "cohere"}
NO_BIAS_TYPES = RMSNORM_TYPES | {"olmo", "stablelm"}
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (zero/config.py:228)


@dataclass(frozen=True)
class Architecture:
    """What the memory model needs from a model's architecture.

    Attributes:
        num_params: all parameters (the tied embedding counted once, as DeepSpeed's profile counts it).
        activation_bytes_per_sample: activation memory per sample, bytes (module docstring).
        largest_layer_params: the largest single module (an embedding or one MLP matrix).
        persistent_params: parameters in tensors of at most ``persistence_threshold`` elements
            (norms, biases): ZeRO-3 keeps them gathered.
        seq_len: the sequence length used for the activations.
    """

    num_params: int
    activation_bytes_per_sample: int
    largest_layer_params: int
    persistent_params: int
    seq_len: int


def _get(cfg: dict[str, Any], names: tuple[str, ...], what: str, source: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            value = cfg[n]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{source}: {n} = {value!r}: expected a positive number ({what})")
            return int(value)
    if default is None:
        raise ConfigError(f"{source}: no {what} ({' or '.join(names)}): not a transformer config zerotune can read")
    return default


def architecture(cfg: dict[str, Any], seq_len: int | None = None, bytes_per_activation: int = 2,
                 flash_attention: bool = False, checkpointing: bool = False, source: str = "config.json",
                 persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD) -> Architecture:
    """The :class:`Architecture` of a Hugging Face config (the dict of its ``config.json``).

    Args:
        seq_len: tokens per sample (default: the config's maximum positions).
        bytes_per_activation: 2 for fp16/bf16 training, 4 for fp32.
        flash_attention: leave out the attention-score term (module docstring).
        checkpointing: activation checkpointing of every layer (module docstring).
        source: the file name, for messages.

    Raises:
        ConfigError: a size is missing or not a positive number (the message names the key).
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object (a Hugging Face config.json)")
    mtype = str(cfg.get("model_type", "")).lower()
    h = _get(cfg, ("hidden_size", "n_embd", "d_model"), "hidden size", source)
    layers = _get(cfg, ("num_hidden_layers", "n_layer", "num_layers"), "number of layers", source)
    heads = _get(cfg, ("num_attention_heads", "n_head"), "attention heads", source)
    kv_heads = _get(cfg, ("num_key_value_heads",), "key/value heads", source, default=heads)
    ffn = _get(cfg, ("intermediate_size", "n_inner", "ffn_dim"), "MLP width", source, default=4 * h)
    vocab = _get(cfg, ("vocab_size",), "vocabulary size", source)
    positions = _get(cfg, ("max_position_embeddings", "n_positions", "n_ctx"), "maximum positions", source,
                     default=seq_len or 0)
    s = seq_len or positions
    if not s:
        raise ConfigError(f"{source}: no max_position_embeddings or n_positions: give --seq-len")
    head_dim = h // heads
    gated = str(cfg.get("hidden_act", cfg.get("activation_function", ""))).lower() in ("silu", "swiglu", "swish",
                                                                                         "gelu_pytorch_tanh") \
        and mtype in RMSNORM_TYPES
    bias = mtype not in NO_BIAS_TYPES and bool(cfg.get("bias", cfg.get("attention_bias", True)))
    rmsnorm = mtype in RMSNORM_TYPES
    tied = bool(cfg.get("tie_word_embeddings", True))

    kv = kv_heads * head_dim
    attn = [h * h, h * kv, h * kv, h * h] + ([h, kv, kv, h] if bias else [])  # q, k, v, o (+ biases)
    if mtype == "qwen2":  # biases on q, k, v only
        attn += [h, kv, kv]
    mlp = [h * ffn] * (3 if gated else 2) + (([ffn, h] if not gated else []) if bias else [])
    norms = [h] * (2 if rmsnorm else 4)  # two norms per layer: weight (and bias for LayerNorm)
    layer = attn + mlp + norms
    final_norm = [h] * (1 if rmsnorm else 2)
    offset = 2 if mtype == "opt" else 0  # OPTLearnedPositionalEmbedding keeps 2 extra positions
    embeddings = [vocab * h] + ([] if mtype in ROTARY_TYPES else [(positions + offset) * h])
    head = [] if tied else [vocab * h]
    tensors = layer * layers + final_norm + embeddings + head
    num_params = sum(tensors)
    persistent = sum(t for t in tensors if t <= persistence_threshold)

    per_layer = s * h * (18 + 4 * ffn / h) + (0 if flash_attention else 5 * heads * s * s)
    kept = layers * 2 * s * h + per_layer if checkpointing else layers * per_layer
    act = (kept + 6 * s * vocab) * bytes_per_activation / 2
    return Architecture(num_params=num_params, activation_bytes_per_sample=int(act),
                        largest_layer_params=max(tensors), persistent_params=persistent, seq_len=s)


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` (a directory holding one is accepted).

    Raises:
        ConfigError: missing, unreadable or not JSON (naming the path).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"--hf-config {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hf-config {path}: not JSON ({e.msg}, line {e.lineno})") from None
