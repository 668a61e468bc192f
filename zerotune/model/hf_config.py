"""A model's size and activation memory from its Hugging Face ``config.json``, with no weights (D315, D319).

Rules (`architecture`): parameters are counted on the model transformers builds on the meta device
(`zerotune.model.meta_model`) and activations on its training forward over fake tensors (`zerotune.model.fake_forward`),
else both in closed form (`_closed_form`) with each layout choice named in `Architecture.notes`. Activations are
bytes per sample, 16-bit (twice that in fp32); a vision-language config counts its language model's only, and a
mixture of experts' MLP counts at the width a token runs through. The keys read are `KEY_GROUPS`; a key the config
omits takes the default of transformers' config class for its ``model_type`` (`type_defaults`, for `FAMILIES`), as
``from_pretrained`` would, each named in the notes; a key set to ``null`` takes no class default and is derived.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.core import user_files
from zerotune.core.errors import ConfigError
from zerotune.model import fake_forward, meta_model

ROTARY_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox", "gptj",
                "falcon", "olmo", "olmo2", "starcoder2", "stablelm", "cohere", "deepseek_v2", "internlm2"}
RMSNORM_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "deepseek_v2",
                 "internlm2", "cohere"}
NO_BIAS_TYPES = RMSNORM_TYPES | {"olmo", "stablelm"}
LEARNED_POSITION_TYPES = {"gpt2", "opt", "bert", "roberta"}
FAMILIES = ROTARY_TYPES | RMSNORM_TYPES | NO_BIAS_TYPES | LEARNED_POSITION_TYPES
"""The model types whose omitted keys take transformers' defaults (`type_defaults`)."""

# The keys read, each a group of the names different model types give it (the first present is taken).
HIDDEN = ("hidden_size", "n_embd", "d_model")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
HEADS = ("num_attention_heads", "n_head")
KV_HEADS = ("num_key_value_heads",)
FFN = ("intermediate_size", "n_inner", "ffn_dim")
VOCAB = ("vocab_size",)
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
TIED = ("tie_word_embeddings",)
ACTIVATION = ("hidden_act", "activation_function")
BIAS = ("bias", "attention_bias")
KEY_GROUPS = (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, POSITIONS, TIED, ACTIVATION, BIAS)

FALLBACK_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 2048,
                              "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}),
    "mistral": ("MistralConfig", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                                  "max_position_embeddings": 131072, "tie_word_embeddings": False,
                                  "hidden_act": "silu"}),
    "qwen2": ("Qwen2Config", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 32, "intermediate_size": 22016, "vocab_size": 151936,
                              "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu"}),
    "gpt2": ("GPT2Config", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
                            "tie_word_embeddings": True, "activation_function": "gelu_new"}),
    "opt": ("OPTConfig", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
                          "vocab_size": 50272, "max_position_embeddings": 2048, "tie_word_embeddings": True,
                          "activation_function": "relu"}),
}
"""transformers' defaults (5.23) for the read keys of the most common families, used only where transformers
cannot be imported; tests hold them equal to the installed transformers'."""
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (zero/config.py:228)


@dataclass(frozen=True)
class Architecture:
    """What the memory model needs from a model's architecture.

    Attributes:
        num_params, active_params: all parameters (a tied embedding once, as DeepSpeed's profile counts it), and
            those a token runs through (all but the routed experts it skips).
        activation_bytes_per_sample: activation memory per sample, bytes (module docstring).
        largest_layer_params: the largest single module (an embedding or one MLP matrix).
        persistent_params: parameters in tensors of at most ``persistence_threshold`` elements (norms, biases),
            which ZeRO-3 keeps gathered.
        seq_len: the sequence length used for the activations.
        notes: one line per key its model type's config class filled in (`type_defaults`) and per value assumed
            (the closed form, MoE activations).
        built_by, activations_counted: the class transformers built on the meta device, and the attention kernel
            whose fake forward counted the activations; '' where the closed form counted them.
        experts: ``(k, E)``, experts per token and routed experts per layer; ``(0, 0)`` for a dense model.
    """

    num_params: int
    activation_bytes_per_sample: int
    largest_layer_params: int
    persistent_params: int
    seq_len: int
    notes: tuple[str, ...] = ()
    active_params: int = 0
    built_by: str = ""
    experts: tuple[int, int] = (0, 0)
    activations_counted: str = ""


def type_defaults(model_type: str) -> tuple[str, dict[str, Any], bool]:
    """What transformers' config class for ``model_type`` defaults the read keys to: ``(class name, {key: default},
    fallback)``, None defaults left out (derived from other keys, as here); ``fallback`` when `FALLBACK_DEFAULTS`
    gave them (transformers not importable). ``("", {}, False)`` for a type not in `FAMILIES` or one neither knows."""
    if model_type not in FAMILIES:
        return "", {}, False
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except Exception:  # noqa: BLE001 - not installed, or an install that fails to import: the table
        name, defaults = FALLBACK_DEFAULTS.get(model_type, ("", {}))
        return name, dict(defaults), bool(defaults)
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:  # a transformers older than the type
        return "", {}, False
    params = inspect.signature(cls.__init__).parameters
    keys = [k for group in KEY_GROUPS for k in group]
    return cls.__name__, {k: params[k].default for k in keys if k in params
                          and params[k].default not in (None, inspect.Parameter.empty)}, False


def _with_type_defaults(cfg: dict[str, Any], mtype: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``cfg`` with the key groups that matter for ``mtype`` and that it omits filled (`type_defaults`), a note each."""
    groups = [g for g in KEY_GROUPS if (g != ACTIVATION or mtype in RMSNORM_TYPES)
              and (g != BIAS or mtype not in NO_BIAS_TYPES) and not any(k in cfg for k in g)]
    if not groups or mtype not in FAMILIES:
        return cfg, ()
    name, defaults, fallback = type_defaults(mtype)
    filled, notes = dict(cfg), []
    for group in groups:
        key = next((k for k in group if k in defaults), None)
        if key is not None:
            filled[key] = defaults[key]
            notes.append(f"{key} not in the config: {name}'s default {defaults[key]!r}"
                         + (" (transformers not importable: zerotune's copy)" if fallback else ""))
    return filled, tuple(notes)


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
                 attention: str = "eager", checkpointing: bool = False, source: str = "config.json",
                 persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD) -> Architecture:
    """The `Architecture` of a Hugging Face config (the dict of its ``config.json``).

    Args:
        seq_len: tokens per sample (default: the config's maximum positions).
        bytes_per_activation: 2 for fp16/bf16 training, 4 for fp32.
        attention: ``eager``, ``sdpa`` or ``flash`` (`zerotune.model.fake_forward.KERNELS`; the closed form leaves
            out the attention scores for the last two).
        checkpointing: every layer checkpointed: a layer keeps only its input, and one layer's activations are live
            again while it is recomputed.

    Raises:
        ConfigError: a size missing or not positive, or a hidden size the heads do not divide (naming the key).
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object (a Hugging Face config.json)")
    full, cfg, vlm = _language_model(cfg)
    mtype = str(cfg.get("model_type", "")).lower()
    cfg, notes = _with_type_defaults(cfg, mtype)
    notes += vlm
    h = _get(cfg, HIDDEN, "hidden size", source)
    layers = _get(cfg, LAYERS, "number of layers", source)
    heads = _get(cfg, HEADS, "attention heads", source)
    kv_heads = _get(cfg, KV_HEADS, "key/value heads", source, default=heads)
    ffn = _get(cfg, FFN, "MLP width", source, default=4 * h)
    vocab = _get(cfg, VOCAB, "vocabulary size", source)
    positions = _get(cfg, POSITIONS, "maximum positions", source, default=seq_len or 0)
    s = seq_len or positions
    if not s:
        raise ConfigError(f"{source}: no max_position_embeddings or n_positions: give --seq-len")
    if h % heads and not cfg.get("head_dim"):  # transformers' attention reshapes hidden into heads x (hidden / heads)
        raise ConfigError(f"{source}: hidden size {h} is not a multiple of {heads} attention heads, and no head_dim "
                          "says the heads' width")
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
    rest = final_norm + embeddings + head  # the layers' tensors by arithmetic: a list of all is num_hidden_layers long
    if (built := meta_model.build(full, persistence_threshold, source)) is None:
        built = meta_model.MetaModel("", sum(layer) * layers + sum(rest), max(layer + rest),
                                     sum(t for t in layer if t <= persistence_threshold) * layers
                                     + sum(t for t in rest if t <= persistence_threshold))
        notes += (f"parameters counted by zerotune's closed form (transformers builds no {full.get('model_type')} "
                  f"model here): a dense {'gated (3-matrix)' if gated else '2-matrix'} MLP of width {ffn} per layer, "
                  f"{'RMSNorm' if rmsnorm else 'LayerNorm'}, {'biases' if bias else 'no biases'}, "
                  f"{'rotary' if mtype in ROTARY_TYPES else 'learned'} positions, head_dim = hidden {h} / {heads} heads"
                  + (", the language model only" if vlm else ""),)
    act, kernel, more = _activations(full, cfg, built, (s, h, heads, ffn, layers, vocab), bytes_per_activation,
                                     attention, checkpointing)
    return Architecture(num_params=built.num_params, activation_bytes_per_sample=int(act),
                        largest_layer_params=built.largest_tensor, persistent_params=built.persistent_params,
                        seq_len=s, notes=notes + more, active_params=built.active_params, built_by=built.class_name,
                        experts=(built.experts_per_token, built.num_experts),
                        activations_counted=kernel)


def _activations(full: dict[str, Any], cfg: dict[str, Any], built: meta_model.MetaModel, dims: tuple[int, ...],
                 bytes_per_activation: int, attention: str, checkpointing: bool) -> tuple[int, str, tuple[str, ...]]:
    """``(bytes, kernel, notes)``: one sample's activations counted on the built model's fake forward (``kernel``:
    its attention), else by the closed form (``kernel`` '') for ``dims`` = ``(s, h, heads, ffn, layers, vocab)``."""
    counted = (fake_forward.count(full, dims[0], "float32" if bytes_per_activation == 4 else "bfloat16", attention)
               if built.class_name else None)
    if counted is not None and (counted.checkpointed is not None or not checkpointing):
        return (counted.checkpointed if checkpointing else counted.plain), counted.attention, \
            (counted.note,) if counted.note else ()
    notes: tuple[str, ...] = ()
    s, h, heads, ffn, layers, vocab = dims
    if built.experts_per_token:
        ffn, note = _routed_width(cfg, built, ffn)
        notes += (note,)
    if built.class_name:
        notes += (f"activations by the closed form: {built.class_name}'s forward did not run on fake tensors",)
    act = _closed_form(s, h, heads, ffn, layers, vocab, attention, checkpointing) * bytes_per_activation / 2
    return int(act), "", notes


def _closed_form(s: int, h: int, heads: int, ffn: int, layers: int, vocab: int, attention: str,
                 checkpointing: bool) -> float:
    """One sample's activations in 16 bits, bytes, by Korthikanti et al. 2022, sec. 4.1, eq. (1) (s = sequence
    length, h = hidden size, a = heads, V = vocabulary): a layer stores ``s*h*(18 + 4*ffn/h)`` (34*s*h at ffn = 4h)
    plus the attention scores, softmax and dropout mask, ``5*a*s^2``, which the sdpa and flash kernels do not store;
    the logits in 16 bits and their fp32 copy add ``6*s*V``. A gated MLP (SwiGLU) counts as one of width ffn, a
    slight underestimate. With checkpointing (sec. 5) a layer keeps its input, ``2*s*h``, plus one layer recomputed."""
    per_layer = s * h * (18 + 4 * ffn / h) + (0 if attention != "eager" else 5 * heads * s * s)
    kept = layers * 2 * s * h + per_layer if checkpointing else layers * per_layer
    return kept + 6 * s * vocab


def _language_model(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    """``(the whole config, the language model's, notes)``: a vision-language config (a ``text_config`` and no hidden
    size of its own) has its language model's sizes in ``text_config``; its activations are the language model's."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or any(k in cfg for k in HIDDEN):
        return cfg, cfg, ()
    return cfg, text, (f"activations of the language model ({text.get('model_type')} text_config) only: the vision "
                       f"tower's ({(cfg.get('vision_config') or {}).get('model_type')}) are not counted",)


def _routed_width(cfg: dict[str, Any], built: meta_model.MetaModel, ffn: int) -> tuple[int, str]:
    """The MLP width a token's activations see in a mixture-of-experts layer, and the note saying so: ``k`` routed
    experts of ``moe_intermediate_size`` (else ``intermediate_size``) plus the shared experts'
    (``shared_expert_intermediate_size``, else ``n_shared_experts`` of the routed width)."""
    expert = cfg.get("moe_intermediate_size") or ffn
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * expert
    width = built.experts_per_token * expert + shared
    return width, (f"MoE activations: each token through {built.experts_per_token} of {built.num_experts} experts "
                   f"of MLP width {expert}" + (f" and shared experts of width {shared}" if shared else "")
                   + f", counted as one MLP of width {width} in every layer")


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` (or of a directory holding one), read by `zerotune.core.user_files`'s rule.

    Raises:
        ConfigError: naming ``--hf-config`` and the path, as `zerotune.core.user_files.load_object` does.
    """
    return user_files.load_object(*user_files.file_in(path, "config.json", "--hf-config"),
                                  "expected a Hugging Face config.json")
