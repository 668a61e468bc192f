"""The probe's profile-run record: bytes saved for the backward pass in the first forward, counted exactly.

In process, on a stand-in engine class (the probe wraps whatever ``DeepSpeedEngine`` the engine
module defines), so no launcher runs.
"""
import json
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.helpers.probe import Checkpointed, LabelsLoss, counted_gpt2, engine_module, profile_record
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV, PROBE_PATH, read_saved_activations, read_square_activations
from zerotune.probe._zerotune_probe.activations import _LayerCheckpointing, _SavedActivations
from zerotune.probe._zerotune_probe.engine import _install
from zerotune.probe._zerotune_probe.growth import _room_for, _StepGrowth, _widen, find_loss, growth_bytes
from zerotune.probe._zerotune_probe.peak import _DataPeak, _device_peak, cap_allocator
from zerotune.probe._zerotune_probe.records import _Probe


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


def test_the_profile_forward_records_the_saved_storages_less_parameters_and_buffers(tmp_path):
    torch.manual_seed(0)
    record = profile_record(tmp_path, Scaled(), torch.randn(3, 8))
    # fp32, mbs 3: input 3x8 (96 B), fc1 output 3x16 (192 B, GELU's input), product 3x16 (192 B,
    # fc2's input): 480 B in 3 storages
    # fc1 holds 8*16 + 16 = 144 parameters, the most of any module; no ZeRO-3 here, so none persistent
    # on CPU the profiler counts the forward's allocations: fc1's output, GELU's and the product (192 B each) live
    # at once, 576 B; the module's output is no scalar loss, so no backward and no slope
    assert record == {"saved_bytes": 480, "saved_storages": 3, "micro_batch_size": 3, "largest_layer_params": 144,
                      "persistent_params": 0, "forward_growth_bytes": 576}
    assert read_saved_activations(tmp_path) == 160  # per sample


def test_the_shapes_count_zero3s_full_parameters_and_its_persistent_ones():
    model = nn.Sequential(nn.Embedding(100, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    for p in model.parameters():  # as ZeRO-3 leaves them: an empty partition, the full count in ds_numel
        p.ds_numel, p.data = p.numel(), torch.empty(0)
    for p in model[1].parameters():
        p.ds_persist = True  # zero/parameter_offload.py:317-330
    # the embedding's 800 parameters are the most one module holds; the LayerNorm's 8 + 8 stay gathered
    assert _SavedActivations._shapes(model) == {"largest_layer_params": 800, "persistent_params": 16}


def test_on_cuda_the_record_holds_the_devices_peak_outside_and_inside_the_allocator():
    # a stand-in for torch.cuda (no GPU on this machine): 80 GB device, 70 GB free, 6 GB reserved now, 9 GB at
    # the peak: the 4 GB outside the allocator (context, NCCL) plus the reserved high-water mark
    cuda = types.SimpleNamespace(is_available=lambda: True, mem_get_info=lambda: (70 * 10**9, 80 * 10**9),
                                 memory_reserved=lambda: 6 * 10**9, max_memory_reserved=lambda: 9 * 10**9)
    engine = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert _device_peak(types.SimpleNamespace(cuda=cuda), engine) == {"device_peak_bytes": 13 * 10**9}
    assert _device_peak(torch, types.SimpleNamespace(device=torch.device("cpu"))) == {}


def test_an_ordinary_forward_records_nothing_and_runs_as_before(tmp_path):
    module = engine_module(profile=False)
    _install(module, _Probe(str(tmp_path)))
    torch.manual_seed(0)
    engine = module.DeepSpeedEngine(Scaled())
    loss = engine.forward(torch.randn(3, 8))
    loss.backward()
    assert engine.module.fc1.weight.grad.shape == (16, 8)
    assert not (tmp_path / "activations.json").exists() and read_saved_activations(tmp_path) is None


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_checkpointed_region_is_counted_once_more_with_gradients_as_its_recomputation(tmp_path, use_reentrant):
    torch.manual_seed(0)
    record = profile_record(tmp_path, Checkpointed(use_reentrant), torch.randn(3, 8, requires_grad=True))
    # fp32, mbs 3: the forward saves each block's input only, 3x8 (96 B) twice; recomputing one block saves
    # fc1's output (GELU's input) and GELU's output (fc2's input), 3x16 each (192 B), its input not counted
    # again: 384 B, the most of the 2 regions
    assert {k: record[k] for k in ("saved_bytes", "saved_storages", "recompute_bytes", "recompute_regions")} == \
        {"saved_bytes": 192, "saved_storages": 2, "recompute_bytes": 384, "recompute_regions": 2}
    assert read_saved_activations(tmp_path) == (192 + 384) // 3  # per sample, at the backward's peak
    # the entry points are restored once the profile forward has exited
    assert torch.utils.checkpoint.CheckpointFunction.__module__ == "torch.utils.checkpoint"
    assert torch.utils.checkpoint._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"


def test_outside_the_profile_forward_checkpointing_runs_as_before(tmp_path):
    module = engine_module(profile=False)
    _install(module, _Probe(str(tmp_path)))
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant=True)
    engine = module.DeepSpeedEngine(model)
    engine.forward(torch.randn(3, 8, requires_grad=True)).backward()
    assert model.blocks[0][0].weight.grad.shape == (16, 8)
    assert not (tmp_path / "activations.json").exists()


def test_a_checkpointed_gpt2_layer_counts_what_it_saves_without_checkpointing(tmp_path):
    plain = counted_gpt2(tmp_path / "plain", 3, checkpointing=False, layers=1)
    checkpointed = counted_gpt2(tmp_path / "checkpointed", 3, checkpointing=True, layers=1)
    # one layer: the forward keeps its input and the rest of the model (embeddings, head, loss); the layer's
    # recomputation saves the rest of what the plain forward saves, to the byte
    assert checkpointed["saved_bytes"] + checkpointed["recompute_bytes"] == plain["saved_bytes"]
    assert checkpointed["recompute_regions"] == 1 and "recompute_bytes" not in plain
    # two layers: two regions of the same size; the plain forward saves a second layer's whole activations,
    # the checkpointed one only its input (fp32 3 x 32 x 64: 24,576 bytes)
    plain2 = counted_gpt2(tmp_path / "plain2", 3, checkpointing=False, layers=2)
    checkpointed2 = counted_gpt2(tmp_path / "checkpointed2", 3, checkpointing=True, layers=2)
    layer = plain2["saved_bytes"] - plain["saved_bytes"]
    assert checkpointed2["recompute_bytes"] == checkpointed["recompute_bytes"] == layer - 24_576
    assert checkpointed2["saved_bytes"] == checkpointed["saved_bytes"] + 24_576
    assert checkpointed2["recompute_regions"] == 2


class GradientCheckpointingLayer(nn.Module):
    """A stand-in for transformers' ``modeling_layers.GradientCheckpointingLayer``: the probe knows the class by
    its name."""

    gradient_checkpointing = False


class Layer(GradientCheckpointingLayer):
    """Linear(8, 16) -> GELU -> Linear(16, 8), times a ``scale`` given as a keyword argument."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, scale=None):
        return self.fc2(nn.functional.gelu(self.fc1(x))) * scale


class Layered(nn.Module):
    """Two :class:`Layer` calls sharing one scale, then a Linear(8, 4) head outside any layer."""

    def __init__(self):
        super().__init__()
        self.layers, self.head = nn.ModuleList([Layer(), Layer()]), nn.Linear(8, 4)

    def forward(self, x):
        scale = torch.full((8,), 0.5)
        for layer in self.layers:
            x = layer(x, scale=scale)
        return self.head(x)


def test_checkpointable_layers_price_checkpointing_from_the_plain_forward(tmp_path):
    torch.manual_seed(0)
    model = Layered()
    record = profile_record(tmp_path, model, torch.randn(3, 8))
    # fp32, mbs 3. Each layer saves its input x (3x8, 96 B), fc1's output (3x16, 192 B), GELU's output (192 B) and
    # the scale (8, 32 B, for the product's gradient); the head saves the second layer's output (96 B):
    # 96 + 192 + 192 + 32 + 96 + 192 + 192 + 96 = 1,088 B, the scale once.
    # Checkpointed: outside any layer the head's input (96 B); the layers' inputs, the input (96 B), the first
    # layer's output (96 B) and the scale (32 B, a keyword argument); the most one layer saves beyond its inputs,
    # 192 + 192 B: 96 + 96 + 96 + 32 + 384 = 704 B
    assert {k: record[k] for k in ("saved_bytes", "checkpointed_bytes", "checkpoint_layers")} == \
        {"saved_bytes": 1_088, "checkpointed_bytes": 704, "checkpoint_layers": 2}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # removed at exit
    for layer in model.layers:  # checkpointed already: nothing to price
        layer.gradient_checkpointing = True
    record = profile_record(tmp_path / "checkpointed", model, torch.randn(3, 8))
    assert record["saved_bytes"] == 1_088 and "checkpointed_bytes" not in record


def test_a_failure_in_the_layer_counting_is_printed_once_and_leaves_the_rest(tmp_path, monkeypatch, capsys):
    def failing(module, count):
        def count_or_fail(storages, tensor, exclude=frozenset()):
            raise RuntimeError("no storage")
        return _LayerCheckpointing([m for m in module.modules() if isinstance(m, Layer)], count_or_fail)
    monkeypatch.setattr(_LayerCheckpointing, "for_module", staticmethod(failing))
    torch.manual_seed(0)
    record = profile_record(tmp_path, Layered(), torch.randn(3, 8))
    assert record["saved_bytes"] == 1_088 and "checkpointed_bytes" not in record
    assert capsys.readouterr().err.count("checkpointing not priced") == 1


def test_a_plain_gpt2_prices_its_checkpointing_as_the_checkpointed_forward_counts_it(tmp_path):
    # the plain forward's checkpointed_bytes is what the same model saves with non-reentrant checkpointing of
    # every block (saved_bytes) plus the block its backward recomputes (recompute_bytes), to the byte
    for layers in (1, 3):
        plain = counted_gpt2(tmp_path / f"plain{layers}", 3, checkpointing=False, layers=layers)
        checkpointed = counted_gpt2(tmp_path / f"checkpointed{layers}", 3, checkpointing=True, layers=layers)
        assert plain["checkpointed_bytes"] == checkpointed["saved_bytes"] + checkpointed["recompute_bytes"]
        assert plain["checkpoint_layers"] == checkpointed["recompute_regions"] == layers
        assert "checkpointed_bytes" not in checkpointed  # its blocks are checkpointed
    # each block more keeps its input only: fp32 3 x 32 x 64, 24,576 bytes
    assert plain["checkpointed_bytes"] - counted_gpt2(tmp_path / "plain2", 3, checkpointing=False, layers=2)[
        "checkpointed_bytes"] == 24_576


def test_the_profile_counts_attention_scores_at_an_odd_length_below_the_batchs(tmp_path):
    # GPT-2 at 32 tokens, heads 32 wide: its per-head queries, keys and values are [3, 2, 32, 32] too. At 31 tokens
    # only the scores are square: 3 fp32 [3, 2, 31, 31] tensors a layer (SDPA's math path: the scores, their softmax
    # and the dropped-out probabilities), 23,064 bytes each
    for layers in (2, 3):
        record = counted_gpt2(tmp_path / f"plain{layers}", 3, checkpointing=False, layers=layers)
        assert (record["square_seq_len"], record["square_saved_bytes"]) == (31, layers * 3 * 23_064)
    assert read_square_activations(tmp_path / "plain2") == {"square_seq_len": 31, "square_saved_bytes": 138_384,
                                                            "micro_batch_size": 3}
    # checkpointed blocks save only their inputs: the one block the backward recomputes at a time is not counted
    assert counted_gpt2(tmp_path / "checkpointed", 3, checkpointing=True)["square_saved_bytes"] == 0
    assert read_square_activations(tmp_path / "nothing") is None


def test_a_plain_llama_prices_the_keyword_inputs_its_checkpoint_keeps(tmp_path):
    # Llama's decoder layer gets position_ids as a keyword argument (1 x 32 int64, 256 bytes), which
    # transformers binds into the checkpointed function (modeling_layers.py, partial(forward, self, **kwargs)):
    # the checkpoint keeps it, and the checkpointed forward's count, which sees the checkpoint's positional
    # inputs only, misses it. Exactly that much apart.
    transformers = pytest.importorskip("transformers")

    def record(name: str, checkpointing: bool) -> dict:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return profile_record(tmp_path / name, LabelsLoss(model), torch.zeros(3, 32, dtype=torch.long), mbs=3)
    plain, checkpointed = record("plain", False), record("checkpointed", True)
    assert plain["checkpointed_bytes"] == checkpointed["saved_bytes"] + checkpointed["recompute_bytes"] + 256
    assert plain["checkpoint_layers"] == checkpointed["recompute_regions"] == 2


DEEPSPEED_CHECKPOINTED = """
import os, torch
import deepspeed
from deepspeed.runtime.activation_checkpointing import checkpointing
from tests.helpers.probe import Checkpointed, profile_record
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False, contiguous_checkpointing=False)
profile_record({directory!r}, Checkpointed(checkpoint=deepspeed.checkpointing.checkpoint),
               torch.randn(3, 8, requires_grad=True))
"""


@pytest.mark.e2e
def test_deepspeeds_own_checkpointing_is_counted_as_torchs(tmp_path):
    # Megatron-style deepspeed.checkpointing keeps a region's inputs outside autograd's saved tensors: the
    # probe counts them as kept; the same blocks as Checkpointed, the same bytes (a process of its own, as
    # DeepSpeed's checkpointing needs a process group)
    import subprocess
    import sys

    from zerotune.deepspeed.launcher import free_port
    root = str(Path(__file__).resolve().parents[2])  # the script imports tests.helpers.probe
    script = DEEPSPEED_CHECKPOINTED.format(port=str(free_port()), directory=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "activations.json").read_text())
    assert {k: record[k] for k in ("saved_bytes", "saved_storages", "recompute_bytes", "recompute_regions")} == \
        {"saved_bytes": 192, "saved_storages": 2, "recompute_bytes": 384, "recompute_regions": 2}


ZERO3_PROFILE = """
import os, sys, torch, transformers, deepspeed
from tests.helpers.probe import LabelsLoss
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32,
                                                             vocab_size=256))
if {checkpointing!r}:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
config = {{"train_micro_batch_size_per_gpu": 3, "zero_optimization": {{"stage": 3}},
          "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
          "autotuning": {{"enabled": True, "model_info": {{"profile": True}},
                         "model_info_path": {directory!r} + "/model_info.json"}}}}
engine, *_ = deepspeed.initialize(model=LabelsLoss(model), config=config, model_parameters=model.parameters())
engine(torch.zeros(3, 32, dtype=torch.long))
"""


@pytest.mark.e2e
def test_deepspeeds_zero3_profile_prices_checkpointing_as_its_checkpointed_profile_counts_it(tmp_path):
    # the real engine, hooked by the probe at start-up as in a launched rank, at ZeRO-3 (its parameters gathered
    # by its own module hooks): the plain profile's checkpointed_bytes is the checkpointed profile's saved_bytes
    # plus recompute_bytes, to the byte
    pytest.importorskip("transformers")
    import subprocess
    import sys

    from zerotune.deepspeed.launcher import free_port
    root = str(Path(__file__).resolve().parents[2])
    records = {}
    for checkpointing in (False, True):
        directory = tmp_path / str(checkpointing)
        directory.mkdir()
        script = ZERO3_PROFILE.format(port=str(free_port()), checkpointing=checkpointing, directory=str(directory))
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={
            **os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", PROBE_DIR_ENV: str(directory),
            "PYTHONPATH": os.pathsep.join([str(PROBE_PATH), root])})
        assert proc.returncode == 0 and "zerotune probe" not in proc.stderr, proc.stderr[-3000:]
        records[checkpointing] = json.loads((directory / "activations.json").read_text())
    plain, checkpointed = records[False], records[True]
    assert plain["checkpointed_bytes"] == checkpointed["saved_bytes"] + checkpointed["recompute_bytes"]
    assert plain["checkpoint_layers"] == checkpointed["recompute_regions"] == 2


class FakeCuda:
    """A stand-in for ``torch.cuda`` (no GPU here): the allocator's counters, set by the test."""

    def __init__(self, allocated: int):
        self.allocated, self.peak, self.resets = allocated, allocated + 7, 0

    def is_available(self):
        return True

    def reset_peak_memory_stats(self):
        self.peak, self.resets = self.allocated, self.resets + 1

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def memory_reserved(self):
        return 6 * 10**9

    def max_memory_reserved(self):
        return 9 * 10**9

    def mem_get_info(self):
        return 70 * 10**9, 80 * 10**9


class Lossy(nn.Module):
    """Scaled, then a scalar loss, returned as ``kind`` says: a tensor, a dict's "loss", a (loss, output) tuple."""

    def __init__(self, kind: str = "tensor"):
        super().__init__()
        self.inner, self.kind = Scaled(), kind

    def forward(self, x):
        out = self.inner(x)
        loss = out.pow(2).mean()
        return {"tensor": loss, "dict": {"loss": loss, "logits": out}, "tuple": (loss, out), "none": out}[self.kind]


def test_find_loss_takes_the_scalar_that_requires_grad():
    loss, logits = torch.ones(1, requires_grad=True) * 2, torch.ones(3, requires_grad=True) * 2
    assert find_loss(loss, torch.Tensor) is loss
    assert find_loss({"loss": loss, "logits": logits}, torch.Tensor) is loss
    assert find_loss(types.SimpleNamespace(loss=loss), torch.Tensor) is loss
    assert find_loss((loss, logits), torch.Tensor) is loss
    assert find_loss(logits, torch.Tensor) is None  # not a scalar
    assert find_loss(torch.ones(1), torch.Tensor) is None  # no graph
    assert find_loss({"logits": logits}, torch.Tensor) is None
    assert find_loss((), torch.Tensor) is None and find_loss(None, torch.Tensor) is None
    assert growth_bytes(1_500, 1_000) == 500 and growth_bytes(900, 1_000) == 0


@pytest.mark.parametrize("kind", ["tensor", "dict", "tuple"])
def test_on_cuda_the_profile_exit_runs_the_backward_and_records_the_steps_growth(tmp_path, monkeypatch, kind):
    cuda = FakeCuda(allocated=1_000_000)
    fake_torch = types.SimpleNamespace(cuda=cuda, Tensor=torch.Tensor)
    model = Lossy(kind)
    grads = []

    def in_backward(grad):  # the backward allocates: the allocator's peak rises to 1.9 MB above the start
        cuda.peak = max(cuda.peak, 2_900_000)
        grads.append(grad.shape)
    model.inner.fc1.weight.register_hook(in_backward)

    def for_profile(engine):  # the stand-in engine on a CUDA device, seen through the fake torch.cuda
        engine.device = torch.device("cuda", 0)
        growth = _StepGrowth(fake_torch, engine)
        real_forward = engine.module.forward

        def forward(x):  # the forward's own peak: 1.4 MB above the start
            out = real_forward(x)
            cuda.peak = max(cuda.peak, 2_400_000)
            return out
        engine.module.forward = forward
        return growth
    monkeypatch.setattr(_StepGrowth, "for_profile", staticmethod(for_profile))
    torch.manual_seed(0)
    record = profile_record(tmp_path, model, torch.randn(3, 8), mbs=3)
    assert cuda.resets == 1 and grads == [(16, 8)]  # the backward ran once, to the first layer
    assert record["forward_growth_bytes"] == 1_400_000 and record["step_growth_bytes"] == 1_900_000
    # the device's peak as the forward ended, reserved high-water mark (kept across the reset) plus the outside
    assert record["device_peak_bytes"] == 13 * 10**9 and record["micro_batch_size"] == 3
    assert read_saved_activations(tmp_path) is not None
    assert not model._forward_hooks  # the hook is gone


def test_without_a_scalar_loss_only_the_forwards_growth_is_recorded_and_the_exit_goes_on(tmp_path, monkeypatch,
                                                                                         capsys):
    cuda = FakeCuda(allocated=1_000)
    monkeypatch.setattr(_StepGrowth, "for_profile", staticmethod(
        lambda engine: _StepGrowth(types.SimpleNamespace(cuda=cuda, Tensor=torch.Tensor), engine)))
    module = engine_module(profile=True)
    _install(module, _Probe(str(tmp_path)))
    engine = module.DeepSpeedEngine(Lossy("none"))
    engine.device = torch.device("cuda", 0)
    with pytest.raises(SystemExit):
        engine.forward(torch.randn(3, 8))
    record = json.loads((tmp_path / "activations.json").read_text())
    assert record["forward_growth_bytes"] == 0 and "step_growth_bytes" not in record
    assert "measuring the backward's growth failed" in capsys.readouterr().err


def test_on_cuda_each_step_records_the_allocated_bytes_before_its_first_forward(tmp_path, monkeypatch):
    allocated = iter([100, 5_000, 5_000])  # before step 1 (no optimizer states yet), before step 2, ...
    for name, value in (("is_available", lambda: True), ("memory_allocated", lambda: next(allocated)), ("max_memory_allocated", lambda: 9_000),
                        ("max_memory_reserved", lambda: 10_000), ("memory_reserved", lambda: 10_000),
                        ("mem_get_info", lambda: (0, 10_000))):
        monkeypatch.setattr(torch.cuda, name, value)
    module = engine_module(profile=False)
    _install(module, _Probe(str(tmp_path)))
    engine = module.DeepSpeedEngine(Scaled())
    engine.device, engine.is_gradient_accumulation_boundary = torch.device("cuda", 0), lambda: True
    for _ in range(2):
        engine.forward(torch.randn(3, 8))
        engine.forward(torch.randn(3, 8))  # a second forward in the step: the base stays the first's
        engine.step()
    lines = [json.loads(line) for line in (tmp_path / "probe.rank0.jsonl").read_text().splitlines()]
    assert [(r["step"], r["base_bytes"], r["peak_bytes"]) for r in lines] == [(1, 100, 9_000), (2, 5_000, 9_000)]


class _Cuda:
    """A stand-in for torch.cuda's memory functions: a 80,000-byte device, 1,000 held outside the allocator."""

    def __init__(self, reserved: int = 4_000):
        self.reserved, self.fractions = reserved, []

    def mem_get_info(self, device):
        return 80_000 - 1_000 - self.reserved, 80_000  # (free, total)

    def memory_reserved(self, device):
        return self.reserved

    def set_per_process_memory_fraction(self, fraction, device):
        self.fractions.append((fraction, device))


def test_on_cuda_a_budget_caps_the_caching_allocator_less_what_lies_outside_it():
    cuda = _Cuda()
    # a 41,000-byte budget on an 80,000-byte device with 1,000 bytes outside the allocator: (41,000 - 1,000) / 80,000
    assert cap_allocator(cuda, 1, 41_000) == 0.5
    assert cuda.fractions == [(0.5, 1)]
    # a budget of the whole device leaves the allocator alone
    assert cap_allocator(cuda, 0, 81_000) is None and cuda.fractions == [(0.5, 1)]


def test_the_probe_caps_the_engines_device_before_the_first_forward_only_with_a_budget(tmp_path, monkeypatch, capsys):
    cuda = _Cuda()
    for name in ("mem_get_info", "memory_reserved", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    for name, value in (("is_available", lambda: True), ("memory_allocated", lambda: 0),
                        ("max_memory_allocated", lambda: 0), ("max_memory_reserved", lambda: 0)):
        monkeypatch.setattr(torch.cuda, name, value)
    module = engine_module(profile=False)
    _install(module, _Probe(str(tmp_path)))
    engine = module.DeepSpeedEngine(Scaled())
    engine.device, engine.is_gradient_accumulation_boundary = torch.device("cuda", 3), lambda: True
    monkeypatch.setenv(BUDGET_ENV, "21000")
    engine.forward(torch.randn(3, 8))
    engine.forward(torch.randn(3, 8))  # once, before the first forward
    assert cuda.fractions == [(0.25, 3)]
    assert "device 3's caching allocator capped at 0.2500 of the device (budget 21000 bytes)" in capsys.readouterr().err


def test_an_experiment_on_cuda_ranks_carries_its_budget_and_a_training_command_does_not(tmp_path):
    from zerotune.core.launch import LaunchSpec, Node, Reservation
    from zerotune.deepspeed.launcher import launch_env
    one = Reservation((Node("localhost", (0,)),))
    gpu = LaunchSpec("x.py", (), cpu=False, device_memory_bytes=24 * 2**30)
    assert launch_env(gpu, one, probe_dir=tmp_path / "z0")[BUDGET_ENV] == "25769803776"
    assert BUDGET_ENV not in launch_env(gpu, one)  # cmd_optimal.txt, zerotune run: no cap
    cpu = LaunchSpec("x.py", (), cpu=True, device_memory_bytes=24 * 2**30)  # RLIMIT_DATA enforces it there
    assert BUDGET_ENV not in launch_env(cpu, one, probe_dir=tmp_path / "z0")


def test_cpu_ranks_under_a_budget_reserve_no_mimalloc_arena_unless_the_user_says(tmp_path, monkeypatch):
    from zerotune.core.launch import LaunchSpec, Node, Reservation
    from zerotune.deepspeed.launcher import MIMALLOC_RESERVE_ENV, launch_env
    one = Reservation((Node("localhost", (0,)),))
    monkeypatch.delenv(MIMALLOC_RESERVE_ENV, raising=False)
    cpu = LaunchSpec("x.py", (), cpu=True, device_memory_bytes=2**31)
    assert launch_env(cpu, one, probe_dir=tmp_path / "z0")[MIMALLOC_RESERVE_ENV] == "0"
    assert MIMALLOC_RESERVE_ENV not in launch_env(cpu, one)  # the answer's command
    for spec in (LaunchSpec("x.py", (), cpu=True), LaunchSpec("x.py", (), cpu=False, device_memory_bytes=2**31)):
        assert MIMALLOC_RESERVE_ENV not in launch_env(spec, one, probe_dir=tmp_path / "z0")
    monkeypatch.setenv(MIMALLOC_RESERVE_ENV, "64MiB")  # the ranks inherit the user's own
    assert MIMALLOC_RESERVE_ENV not in launch_env(cpu, one, probe_dir=tmp_path / "z0")


class Weighted(nn.Module):
    """``(x * w).sum()`` over ``x`` of shape (batch, n): the product, 4n bytes a sample, is the forward's only
    allocation beyond the loss, and the backward's gradient of ``w`` multiplies the same shape once more."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        if x.shape[0] > getattr(self, "fits", x.shape[0]):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return (x * self.w).sum()


def test_on_cpu_the_profile_measures_the_steps_growth_per_sample_from_wider_micro_steps(tmp_path):
    record = profile_record(tmp_path, Weighted(1000), torch.randn(3, 1000), mbs=3)
    # the profile's own step at mbs 3: the product (12,000 B) and the loss (4), then the backward's product
    # (12,000) and w's gradient (4,000) with two scalars: the first step holds w's gradient, which stays
    assert record["forward_growth_bytes"] == 12_004 and record["step_growth_bytes"] == 16_012
    # micro steps at 2, 4, 8 and 16 times the batch (mbs 6 to 48): the backward's product on top of 4,008 bytes
    # (w's gradient, accumulated, and the scalars); the last two differ by 96,000 bytes over 24 samples
    assert record["slope_growth_bytes"] == [28_008, 52_008, 100_008, 196_008]
    assert record["slope_bytes"] == 4_000  # 4 bytes x 1,000 elements a sample: the constant cancels
    assert record["slope_ended"] == "agreed"  # every slope 4,000 bytes
    assert "slope_data_peak_bytes" not in record  # no VmData sampler in this process


def test_a_wider_micro_step_that_runs_out_of_memory_ends_the_series_and_the_slope_takes_the_last_two(
        tmp_path, capsys):
    model = Weighted(1000)
    model.fits = 12  # 8x the batch (24 samples) raises as torch's allocator does under the rank's data limit
    record = profile_record(tmp_path, model, torch.randn(3, 1000), mbs=3)
    assert record["slope_growth_bytes"] == [28_008, 52_008] and record["slope_bytes"] == 4_000
    assert record["slope_ended"] == "failed"
    assert "failed at 8x the profile's batch: RuntimeError" in capsys.readouterr().err
    model.fits = 6  # only 2x runs: one growth, no slope
    record = profile_record(tmp_path / "one", model, torch.randn(3, 1000), mbs=3)
    assert record["slope_growth_bytes"] == [28_008] and "slope_bytes" not in record


def test_widening_repeats_every_tensor_whose_first_dimension_is_the_micro_batch():
    Pair = __import__("collections").namedtuple("Pair", "ids mask")
    ids, mask, table = torch.arange(6).reshape(2, 3), torch.ones(2, 3), torch.zeros(5, 3)
    args, kwargs = _widen(((ids, [table, Pair(ids, mask)]), {"labels": ids, "n": 2,
                                                                         "extra": {"mask": mask}}), 3, 2, torch.Tensor)
    assert args[0].shape == (6, 3) and args[0][:, 0].tolist() == [0, 3, 0, 3, 0, 3]  # the batch repeated, in order
    assert args[1][0] is table  # its first dimension is not the micro batch: as it is
    assert isinstance(args[1][1], Pair) and args[1][1].mask.shape == (6, 3)
    assert kwargs["labels"].shape == (6, 3) and kwargs["n"] == 2 and kwargs["extra"]["mask"].shape == (6, 3)


def test_a_wider_micro_step_runs_only_with_room_under_the_ranks_data_limit(monkeypatch):
    class Sampler:  # VmData now: 600 MB
        def sample(self):
            return 600_000_000
    monkeypatch.setattr(_DataPeak, "running", Sampler())
    import resource
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1_000_000_000, resource.RLIM_INFINITY))
    assert _room_for(200_000_000)  # 800 MB: 80% of the 1 GB limit
    assert not _room_for(200_000_001)
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert _room_for(10**15)  # no limit

