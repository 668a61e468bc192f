"""A Hugging Face model's activations as autograd saves them, counted on transformers' own forward over fake CPU
tensors: no weights, no arithmetic, no memory.

Rules (`count`): the model is built under torch's ``FakeTensorMode`` and runs one training forward on ``seq_len``
token ids with labels (the loss included), dispatching as on a CPU rank: ``eager`` keeps each layer's scores and
softmax, ``sdpa`` its output and log-sum-exp only, as CUDA's flash kernels do (so ``flash`` counts as ``sdpa``,
`KERNELS`). Each storage saved for the backward counts once, parameters and buffers never, as in the profile run's
probe (`zerotune.probe._zerotune_probe.activations`), also under non-reentrant checkpointing of every decoder layer.
Mixtures of experts count ``k`` of ``E`` experts per token; a vision-language model runs its language model only.
"""
from __future__ import annotations

import contextlib
import functools
import json
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["SavedActivations", "count"]

KERNELS = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}
"""The ``attn_implementation`` run for each attention choice of ``estimate --attention``."""


@dataclass(frozen=True)
class SavedActivations:
    """What one sample's training forward saves for the backward, bytes: ``plain`` every storage once,
    ``checkpointed`` with every decoder layer checkpointed (None: no checkpointable layer); ``attention`` the
    ``attn_implementation`` run (``eager`` where the model runs no ``sdpa``), ``note`` why if not the one asked."""

    plain: int
    checkpointed: int | None
    attention: str
    note: str = ""


def count(cfg: dict[str, Any], seq_len: int, dtype: str, attention: str) -> SavedActivations | None:
    """The activations of one sample of ``seq_len`` tokens for the model of the config dict ``cfg`` in ``dtype``
    (``bfloat16``, ``float16`` or ``float32``) with ``attention`` (``eager``, ``sdpa`` or ``flash``), counted once
    per argument set (seconds); None where transformers or fake tensors are not importable or the forward fails on
    fake tensors (a data-dependent operator): the caller then counts in closed form."""
    try:
        return _count(json.dumps(cfg, sort_keys=True), seq_len, dtype, KERNELS[attention])
    except Exception:  # noqa: BLE001 - any failure of transformers' forward on fake tensors: the closed form
        return None


@functools.lru_cache(maxsize=16)
def _count(text: str, seq_len: int, dtype: str, kernel: str) -> SavedActivations:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, note = json.loads(text), ""
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")
        try:
            model = _model(cfg, kernel, getattr(torch, dtype))
        except ValueError as e:  # "... does not support an attention implementation through sdpa yet"
            if kernel == "eager":
                raise
            model, note = _model(cfg, "eager", getattr(torch, dtype)), f"{_first_line(e)}: counted as eager"
            kernel = "eager"
        model.train()
        plain, checkpointed = _saved(model, torch, seq_len)
    return SavedActivations(plain, checkpointed, kernel, note)


def _no_attention_dropout(config) -> None:
    """Set every attention dropout rate of the transformers ``config`` (an attribute naming ``attn`` or ``attention``
    and ``drop``, its sub-configs' too) to 0: CPU's flash kernel takes no dropout and falls back to the math kernel,
    which keeps the scores, where CUDA's kernels keep only the random generator's state."""
    for key, value in config.to_dict().items():
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict") and isinstance(value, dict):
            _no_attention_dropout(sub)
        elif "drop" in key and ("attn" in key or "attention" in key) and isinstance(value, float):
            setattr(config, key, 0.0)


def _model(cfg: dict[str, Any], kernel: str, dtype):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from zerotune.model.meta_model import _from_config

    config = CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    if kernel != "eager":
        _no_attention_dropout(config)
    return _from_config(config, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel,
                        attn_implementation=kernel, dtype=dtype)


def _saved(model, torch, seq_len: int) -> tuple[int, int | None]:
    """(plain, checkpointed) bytes the forward of ``model`` on one sample of ``seq_len`` token ids saves."""
    from zerotune.probe._zerotune_probe.activations import _LayerCheckpointing

    resident = {_key(t) for t in (*model.parameters(), *model.buffers())}
    held: list = []  # every tensor keyed, alive until the count ends: no storage's address is reused meanwhile

    def add(storages: dict, tensor, exclude=frozenset()) -> None:
        held.append(tensor)
        key = _key(tensor)
        if key not in resident and key not in exclude:
            storages[key] = tensor.untyped_storage().nbytes()

    storages: dict[int, int] = {}
    layers = _LayerCheckpointing.for_module(model, add)

    def pack(tensor):
        add(storages, tensor)
        if layers is not None:
            layers.saved(tensor)
        return tensor

    ids = torch.zeros((1, seq_len), dtype=torch.long)
    hooks = layers.hooks() if layers is not None else contextlib.nullcontext()
    with hooks, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    figures = layers.figures() if layers is not None else {}
    return sum(storages.values()), figures.get("checkpointed_bytes")


def _key(tensor) -> int:
    """The identity of ``tensor``'s storage (a fake tensor's storage has no address: its C++ object's)."""
    return tensor.untyped_storage()._cdata


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0].split(". ")[0] if str(error) else type(error).__name__
