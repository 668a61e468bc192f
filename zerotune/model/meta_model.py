"""A Hugging Face config's model as transformers builds it: on the meta device (no weights, no download), its
parameters counted as DeepSpeed counts them.

Rules (`build`): transformers builds every architecture it knows from the config dict (its config class for
``model_type``, then a causal LM, else an image-text-to-text model, else the base model: `_from_config`) under
``torch.device("meta")``: shapes, no storage. A tied tensor counts once, as ZeRO partitions it once. In a mixture of
experts the routed experts are the parameters under modules named ``experts`` (`count`), and a token runs ``k`` of
their ``E``: `MetaModel.active_params` is ``all - routed * (1 - k / E)``.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.model.flops import active_params

MAX_LAYERS = 1024
"""Layers above which the model is not built (a config's typo such as ``1e12`` would build for hours): the closed
form counts it."""
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


@dataclass(frozen=True)
class MetaModel:
    """A model built on the meta device: ``class_name`` the class transformers built (``MixtralForCausalLM``),
    ``num_params`` (a tied tensor once), ``largest_tensor`` (elements), ``persistent_params`` in tensors of at most
    the persistence threshold (ZeRO-3 keeps them gathered); for a mixture of experts ``routed_params``, ``num_experts``
    ``E`` per layer and ``experts_per_token`` ``k`` (0: dense, or ``k`` unknown)."""

    class_name: str
    num_params: int
    largest_tensor: int
    persistent_params: int
    routed_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def active_params(self) -> int:
        """Parameters a token runs through: all but the routed experts it skips (all, for a dense model)."""
        return active_params(self.num_params, self.routed_params, self.num_experts, self.experts_per_token)


def build(cfg: dict[str, Any], persistence_threshold: int, source: str = "config.json") -> MetaModel | None:
    """The model of the config dict ``cfg`` built by transformers on the meta device, once per config and threshold;
    None where transformers is not importable, does not know ``model_type``, or asks for more than `MAX_LAYERS` layers.

    Raises:
        ConfigError: transformers knows the type and refuses the config (its message, naming ``source``).
    """
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except Exception:  # noqa: BLE001 - not installed, or an install that fails to import: the closed form
        return None
    mtype = cfg.get("model_type")
    layers = max((v for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(v := cfg.get(k), int)),
                 default=0)
    if not isinstance(mtype, str) or mtype not in CONFIG_MAPPING or layers > MAX_LAYERS:
        return None
    return _build(json.dumps(cfg, sort_keys=True), persistence_threshold, source)


@functools.lru_cache(maxsize=8)
def _build(text: str, persistence_threshold: int, source: str) -> MetaModel:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = json.loads(text)
    mtype = cfg["model_type"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = CONFIG_MAPPING[mtype](**{k: v for k, v in cfg.items() if k != "model_type"})
            with torch.device("meta"):
                model = _from_config(config, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel)
    except Exception as e:  # noqa: BLE001 - transformers refusing the config, in whichever error its checks raise
        raise ConfigError(f"{source}: transformers cannot build a {mtype} model from it: {e}") from None
    return count(model, persistence_threshold, _top_k(config))


def _from_config(config, *autos, **kwargs):
    """The model of ``config`` from the first of ``autos`` that maps its type (a causal LM, else an image-text-to-text
    model, else the base model); ``kwargs`` go to each ``from_config`` (``attn_implementation``, ``dtype``)."""
    for auto in autos[:-1]:
        try:
            return auto.from_config(config, **kwargs)
        except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
            continue
    return autos[-1].from_config(config, **kwargs)


def count(model, persistence_threshold: int, experts_per_token: int = 0) -> MetaModel:
    """`MetaModel` of a built ``torch.nn.Module`` (on any device). A module named ``experts`` holds the routed
    experts: one fused tensor per projection with the expert index first, or a list of expert MLPs (a
    ``shared_experts`` module is not routed)."""
    sizes = [p.numel() for p in model.parameters()]
    routed, experts = 0, 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(module.parameters())
        routed += sum(p.numel() for p in params)
        fused = [p for p in params if p.dim() == 3]
        experts = experts or (fused[0].shape[0] if fused else len(module) if hasattr(module, "__len__") else 0)
    return MetaModel(type(model).__name__, sum(sizes), max(sizes, default=0),
                     sum(n for n in sizes if n <= persistence_threshold), routed, experts,
                     experts_per_token if routed else 0)


def _top_k(config) -> int:
    """Experts per token from `TOP_K_KEYS`, a vision-language config's text config first; 0 without one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in TOP_K_KEYS:
        value = getattr(text, key, getattr(config, key, None))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
