"""The probe's profile record, in process: a stand-in engine class (the probe wraps whatever ``DeepSpeedEngine`` the
engine module defines, so no launcher runs), and the models whose saved bytes the tests count."""
import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as bound_checkpoint

from zerotune.probe._zerotune_probe.engine import _install
from zerotune.probe._zerotune_probe.records import _Probe


def engine_module(profile: bool, mbs: int = 3):
    class DeepSpeedEngine:  # the methods the probe calls, and DeepSpeed's exit in the profile forward
        def __init__(self, module):
            self.module, self.global_rank, self._config = module, 0, None

        def autotuning_profile_model_info(self):
            return profile

        def train_micro_batch_size_per_gpu(self):
            return mbs

        def gradient_accumulation_steps(self):
            return 1

        def train_batch_size(self):
            return 6

        def forward(self, x):
            out = self.module(x)
            loss = out.sum() if isinstance(out, torch.Tensor) else out  # a model that returns its loss: as is
            if self.autotuning_profile_model_info():
                exit()  # engine.py:3030
            return loss

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

    return types.SimpleNamespace(DeepSpeedEngine=DeepSpeedEngine)


def profile_record(directory, model: nn.Module, inputs: torch.Tensor, mbs: int = 3) -> dict:
    """The probe's ``activations.json`` after the profile run's first forward of ``model`` on ``inputs``
    (DeepSpeed's exit in it caught), on a stand-in engine at micro batch size ``mbs``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    module = engine_module(profile=True, mbs=mbs)
    _install(module, _Probe(str(directory)))
    try:
        module.DeepSpeedEngine(model).forward(inputs)
    except SystemExit:
        pass
    return json.loads((Path(directory) / "activations.json").read_text())


class Checkpointed(nn.Module):
    """Two blocks, each Linear(8, 16) -> GELU -> Linear(16, 8), each run through ``checkpoint(block, x)``:
    by default torch's, bound at import (as ``transformers.modeling_utils`` binds it)."""

    def __init__(self, use_reentrant: bool = True, checkpoint=None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2))
        self.checkpoint = checkpoint or (lambda block, x: bound_checkpoint(block, x, use_reentrant=use_reentrant))

    def forward(self, x):
        for block in self.blocks:
            x = self.checkpoint(block, x)
        return x


class LabelsLoss(nn.Module):
    """What the Trainer asks of a Hugging Face model: the loss on the input ids as their own labels."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def counted_gpt2(directory, mbs: int, checkpointing: bool, layers: int = 2, hidden: int = 64, heads: int = 2,
                 seq_len: int = 32, vocab: int = 256) -> dict:
    """The probe's profile record of a Hugging Face GPT-2 (built from a config) whose forward is the loss on
    ``mbs`` sequences as their own labels, with or without the model's gradient checkpointing."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq_len, vocab_size=vocab)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return profile_record(directory, LabelsLoss(model), torch.zeros(mbs, seq_len, dtype=torch.long), mbs=mbs)
