"""The probe's profile-run record: bytes saved for the backward pass in the first forward, counted exactly.

In process, on a stand-in engine class (the probe wraps whatever ``DeepSpeedEngine`` the engine
module defines), so no launcher runs.
"""
import json
import types

import torch
import torch.nn as nn

from zerotune.probe import read_saved_activations
from zerotune.probe import sitecustomize as probe_module


class Scaled(nn.Module):
    """Linear -> GELU -> times a buffer -> Linear: saved are the input (for the first weight's
    gradient), the GELU input and the scaled output (fc2's input); the GELU output is not (the
    buffer needs no gradient), the weights (views of parameters, ``weight.t()``) and the buffer
    are saved but are not activations."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)) * self.scale)


def engine_module(profile: bool):
    class DeepSpeedEngine:  # the methods the probe calls, and DeepSpeed's exit in the profile forward
        def __init__(self, module):
            self.module, self.global_rank, self._config = module, 0, None

        def autotuning_profile_model_info(self):
            return profile

        def train_micro_batch_size_per_gpu(self):
            return 3

        def gradient_accumulation_steps(self):
            return 1

        def train_batch_size(self):
            return 6

        def forward(self, x):
            loss = self.module(x).sum()
            if profile:
                exit()  # engine.py:3030
            return loss

        def step(self):
            pass

    return types.SimpleNamespace(DeepSpeedEngine=DeepSpeedEngine)


def test_the_profile_forward_records_the_saved_storages_less_parameters_and_buffers(tmp_path):
    module = engine_module(profile=True)
    probe_module._install(module, probe_module._Probe(str(tmp_path)))
    torch.manual_seed(0)
    engine = module.DeepSpeedEngine(Scaled())
    try:
        engine.forward(torch.randn(3, 8))
    except SystemExit:
        pass
    record = json.loads((tmp_path / "activations.json").read_text())
    # fp32, mbs 3: input 3x8 (96 B), fc1 output 3x16 (192 B, GELU's input), product 3x16 (192 B,
    # fc2's input): 480 B in 3 storages
    # fc1 holds 8*16 + 16 = 144 parameters, the most of any module; no ZeRO-3 here, so none persistent
    assert record == {"saved_bytes": 480, "saved_storages": 3, "micro_batch_size": 3, "largest_layer_params": 144,
                      "persistent_params": 0}
    assert read_saved_activations(tmp_path) == 160  # per sample


def test_the_shapes_count_zero3s_full_parameters_and_its_persistent_ones():
    model = nn.Sequential(nn.Embedding(100, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    for p in model.parameters():  # as ZeRO-3 leaves them: an empty partition, the full count in ds_numel
        p.ds_numel, p.data = p.numel(), torch.empty(0)
    for p in model[1].parameters():
        p.ds_persist = True  # zero/parameter_offload.py:317-330
    # the embedding's 800 parameters are the most one module holds; the LayerNorm's 8 + 8 stay gathered
    assert probe_module._SavedActivations._shapes(model) == {"largest_layer_params": 800, "persistent_params": 16}


def test_on_cuda_the_record_holds_the_devices_peak_outside_and_inside_the_allocator():
    # a stand-in for torch.cuda (no GPU on this machine): 80 GB device, 70 GB free, 6 GB reserved now, 9 GB at
    # the peak: the 4 GB outside the allocator (context, NCCL) plus the reserved high-water mark
    cuda = types.SimpleNamespace(is_available=lambda: True, mem_get_info=lambda: (70 * 10**9, 80 * 10**9),
                                 memory_reserved=lambda: 6 * 10**9, max_memory_reserved=lambda: 9 * 10**9)
    engine = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert probe_module._device_peak(types.SimpleNamespace(cuda=cuda), engine) == {"device_peak_bytes": 13 * 10**9}
    assert probe_module._device_peak(torch, types.SimpleNamespace(device=torch.device("cpu"))) == {}


def test_an_ordinary_forward_records_nothing_and_runs_as_before(tmp_path):
    module = engine_module(profile=False)
    probe_module._install(module, probe_module._Probe(str(tmp_path)))
    torch.manual_seed(0)
    engine = module.DeepSpeedEngine(Scaled())
    loss = engine.forward(torch.randn(3, 8))
    loss.backward()
    assert engine.module.fc1.weight.grad.shape == (16, 8)
    assert not (tmp_path / "activations.json").exists() and read_saved_activations(tmp_path) is None
