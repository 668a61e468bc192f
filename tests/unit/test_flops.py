"""Tests for zerotune.model.flops and its views: model FLOPs per token, MFU, tokens/s per device, exactly."""
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import OBJECTIVES
from zerotune.model.flops import FlopsModel, active_params, peak_tflops, samples_per_s, tokens_per_device
from zerotune.report.data import ReportData, TrainingPlan
from zerotune.report.results import answer_text
from zerotune.report.table_export import experiment_row

# GPT-2 small as DeepSpeed's profile counts it (the tied embedding once), at 1,024 tokens a sample
GPT2 = {"num_params": 124_439_808, "trainable_num_params": 124_439_808, "num_layers": 12, "hidden_size": 768}
GPT2_FLOPS_PER_TOKEN = 6 * 124_439_808 + 12 * 12 * 768 * 1024  # 859,885,056


def profile(**metrics) -> Experiment:
    return Experiment("profile", {"train_micro_batch_size_per_gpu": 1}, kind=ExperimentKind.PROFILE,
                      status=Status.OK, metrics=metrics)


def run(metric=10.0, tokens_per_s=10_240.0, slots=2, **config) -> Experiment:
    """10 samples/s of 1,024 tokens on 2 devices: 5,120 tokens/s per device."""
    return Experiment("z1_gas1_tmbspg4", {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8, **config},
                      num_slots=slots, status=Status.OK, metric=metric, tokens_per_s=tokens_per_s)


def test_the_peak_is_the_first_datasheet_entry_the_device_name_holds():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 NVL") == 835.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA L40S") == 362.0 and peak_tflops("NVIDIA L40") == 181.0
    assert peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("AMD Instinct MI300X") == 1307.0
    assert peak_tflops("cpu") is None and peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_a_mixture_of_experts_counts_the_experts_a_token_runs_through():
    # Mixtral-8x7B: 46.7B parameters, 32 layers x 8 experts x 3 matrices of 4,096 x 14,336 routed, 2 of 8 per token
    assert active_params(46_702_792_704, 32 * 8 * 3 * 4096 * 14336, 8, 2) == 12_879_925_248
    assert active_params(124_439_808, 0, 0, 0) == 124_439_808  # dense
    assert active_params(124_439_808, 10, 8, 0) == 124_439_808  # k unknown: every parameter counts


def test_mfu_is_tokens_per_device_times_palms_flops_per_token_over_the_peak():
    flops = FlopsModel.from_profile([profile(**GPT2, device_name="NVIDIA H100 80GB HBM3")], None)
    assert (flops.params, flops.layers, flops.hidden, flops.peak_flops) == (124_439_808, 12, 768, 989e12)
    assert flops.flops_per_token(1024) == GPT2_FLOPS_PER_TOKEN == 859_885_056
    exp = run()
    assert tokens_per_device(exp) == 5120.0
    assert flops.mfu(exp, "throughput") == pytest.approx(5120 * 859_885_056 / 989e12, rel=1e-12)
    assert flops.mfu(exp, "throughput") == pytest.approx(0.0044515788541, rel=1e-9)
    # latency (s per step): samples/s is train_batch_size / the metric, the same run at 0.8 s a step
    assert samples_per_s(run(metric=0.8), "latency") == 10.0
    # AutoTP 2: train_batch_size 8 counts both ranks of a group that hold one batch of 4 (D334)
    assert samples_per_s(run(metric=0.8, tensor_parallel={"autotp_size": 2}), "latency") == 5.0
    assert flops.mfu(run(metric=0.8), "latency") == pytest.approx(0.0044515788541, rel=1e-9)
    # --peak-tflops wins over the name; without either (a CPU rank) no MFU
    assert FlopsModel.from_profile([profile(**GPT2, device_name="NVIDIA H100 80GB HBM3")], 312.0).mfu(
        exp, "throughput") == pytest.approx(5120 * 859_885_056 / 312e12, rel=1e-12)
    assert FlopsModel.from_profile([profile(**GPT2)], None).mfu(exp, "throughput") is None
    assert flops.mfu(run(tokens_per_s=None), "throughput") is None  # a batch without token ids
    assert flops.mfu(exp, "flops") is None


def test_without_layers_the_attention_term_is_left_out_and_said_so():
    flops = FlopsModel.from_profile([profile(num_params=1000)], 100.0)
    assert flops.flops_per_token(4096) == 6000
    assert "attention term left out" in flops.describe()
    assert FlopsModel.from_profile([Experiment("z0", {}, status=Status.OK, metrics={"num_params": 5})], None) is None


def test_the_summary_and_the_rows_give_tokens_per_device_and_mfu(tmp_path: Path):
    exp = run()
    data = ReportData([profile(**GPT2, device_name="NVIDIA H100 80GB HBM3"), exp], OBJECTIVES["throughput"], None,
                      None, exp, tmp_path)
    assert ("5,120 tokens/s per device, MFU 0.4% (MFU: 6 * 124,439,808 params + 12 * 12 layers * 768 hidden * tokens "
            "per sample FLOPs per token, against NVIDIA H100 80GB HBM3: 989 TFLOP/s dense 16-bit (datasheet))\n"
            in answer_text(data))
    row = experiment_row(exp, data)
    assert row["tokens_per_s_per_device"] == 5120.0
    assert row["mfu"] == pytest.approx(0.0044515788541, rel=1e-9)
    cpu = ReportData([profile(**GPT2), exp], OBJECTIVES["throughput"], None, None, exp, tmp_path)
    assert "5,120 tokens/s per device (MFU: " in answer_text(cpu)
    assert "no peak known for this device: --peak-tflops gives it" in answer_text(cpu)
    given = ReportData([profile(**GPT2), exp], OBJECTIVES["throughput"], None, None, exp, tmp_path,
                       plan=TrainingPlan(peak_tflops=1.0))
    assert experiment_row(exp, given)["mfu"] == pytest.approx(5120 * 859_885_056 / 1e12, rel=1e-12)
