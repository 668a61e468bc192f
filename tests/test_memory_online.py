"""The memory model checked on every run: online correction, exp.json's error, the summary's memory table."""
import pytest

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import activation_slope_bytes
from zerotune.model.memory import MemoryModel
from zerotune.model.online import corrected
from zerotune.model.profile import ModelInfo
from zerotune.probe import step_records
from zerotune.report.results import memory_table, table_text

MODEL = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4, overhead_bytes=100)
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 0}}
# fp32 stage 0 at mbs 2: its 2,000 bytes of activations are freed before the 4,000,000-byte flat copy is made
ESTIMATE = 4_000_000 + 4_000_000 + 8_000_000 + 4_000_000 + 100


def exp(status, peak=None, kind=ExperimentKind.MBS):
    return Experiment("z0_mbs2", CFG, num_slots=4, kind=kind, status=status, peak_memory_bytes=peak)


def ran_at(stage, status, kind=ExperimentKind.MBS):
    """An earlier run of ZeRO ``stage`` (mbs 2) that finished with ``status``."""
    return Experiment(f"z{stage}_mbs2", {**CFG, "zero_optimization": {"stage": stage}}, num_slots=4, kind=kind,
                      status=status)


def at_stage(stage):
    return {**CFG, "zero_optimization": {"stage": stage}}


def test_an_oom_under_a_fitting_estimate_raises_it_just_over_the_budget():
    assert MODEL.bytes_per_device(CFG) == ESTIMATE
    budget = ESTIMATE + 500
    new, why = corrected(MODEL, exp(Status.OOM), budget)
    # no stage ran before: every stage gets the same raise (what one stage missed, the others likely miss too;
    # docs/decisions.md, D108), 501 bytes each
    assert new.stage_overhead_bytes == (501, 501, 501, 501) and new.bytes_per_device(CFG) == budget + 1
    assert new.bytes_per_device(at_stage(1)) == MODEL.bytes_per_device(at_stage(1)) + 501
    assert not new.fits(CFG, budget) and "ran out of memory" in why
    # a stage with a run of its own (ok or out of memory) keeps its overhead: per stage once measured; the profile
    # and a failed run are no run of a stage's own
    earlier = [ran_at(1, Status.OK), ran_at(2, Status.OOM), ran_at(3, Status.FAILED),
               ran_at(3, Status.OK, kind=ExperimentKind.PROFILE)]
    new, _ = corrected(MODEL, exp(Status.OOM), budget, earlier)
    assert new.stage_overhead_bytes == (501, 0, 0, 501)
    assert new.bytes_per_device(at_stage(1)) == MODEL.bytes_per_device(at_stage(1))
    assert new.bytes_per_device(at_stage(3)) == MODEL.bytes_per_device(at_stage(3)) + 501
    # the stage that ran out of memory rises even where it ran before
    new, _ = corrected(MODEL, exp(Status.OOM), budget, [ran_at(0, Status.OK)])
    assert new.stage_overhead_bytes == (501, 501, 501, 501)
    # an OOM the model predicted teaches nothing
    assert corrected(MODEL, exp(Status.OOM), ESTIMATE - 1) == (MODEL, None)


def test_a_peak_above_the_estimate_raises_the_overhead_and_one_below_never_lowers_it():
    new, why = corrected(MODEL, exp(Status.OK, peak=ESTIMATE + 12_345), 10**12)
    # no stage ran before: the same raise for every stage
    assert new.stage_overhead_bytes == (12_345,) * 4 and new.bytes_per_device(CFG) == ESTIMATE + 12_345
    assert "peaked at" in why
    # stages 2 and 3 ran: only stage 0 (the run's) and stage 1 (no run yet) rise
    new, _ = corrected(MODEL, exp(Status.OK, peak=ESTIMATE + 12_345), 10**12,
                       [ran_at(2, Status.OK), ran_at(3, Status.OOM)])
    assert new.stage_overhead_bytes == (12_345, 12_345, 0, 0)
    assert new.bytes_per_device(at_stage(2)) == MODEL.bytes_per_device(at_stage(2))
    assert corrected(MODEL, exp(Status.OK, peak=ESTIMATE - 10**6), 10**12) == (MODEL, None)
    assert corrected(MODEL, exp(Status.OK, peak=None), 10**12) == (MODEL, None)
    # the profile run is the calibration itself, not a correction
    assert corrected(MODEL, exp(Status.OK, peak=ESTIMATE * 2, kind=ExperimentKind.PROFILE), 10**12) == (MODEL, None)


def test_exp_json_carries_predicted_measured_and_error():
    e = exp(Status.OK, peak=1_000_000)
    e.memory_bytes = 1_050_000
    assert round(e.memory_rel_error, 6) == 0.05
    d = e.to_json()
    assert (d["memory_bytes"], d["peak_memory_bytes"], d["memory_rel_error"]) == (1_050_000, 1_000_000, 0.05)
    assert Experiment.from_json(d).memory_rel_error == e.memory_rel_error
    assert exp(Status.OK).memory_rel_error is None


def test_summary_memory_table_has_every_run_with_both_figures():
    runs = []
    for name, predicted, peak in (("a", 1_100, 1_000), ("b", 900, 1_000), ("c", 1_020, 1_000), ("d", None, 1_000)):
        e = Experiment(name, CFG, status=Status.OK, peak_memory_bytes=peak)
        e.memory_bytes = predicted
        runs.append(e)
    text = table_text(memory_table(runs))
    assert "+10.0%" in text and "-10.0%" in text and "+2.0%" in text and " d " not in text
    assert "3 runs: median |error| 10.0%, worst 10.0%" in text
    assert memory_table(runs[3:]) is None


def test_the_activation_slope_comes_from_two_runs_of_one_config_and_keeps_the_calibration():
    profile = {**CFG, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1_000_000},
               "autotuning": {"model_info": {"profile": True}}}
    model = MemoryModel(1_000_000, 5_000_000, 4).calibrated(profile, 900_000_000, mbs=1)
    runs = []
    for mbs, peak in ((1, 500_000_000), (2, 501_500_000), (8, 510_500_000)):
        runs.append(Experiment(f"z0_mbs{mbs}", {**CFG, "train_micro_batch_size_per_gpu": mbs}, status=Status.OK,
                               peak_memory_bytes=peak))
    a, _ = corrected(model, runs[0], 10**12, [])
    assert a.activation_bytes_per_sample == 5_000_000  # one run: no slope
    b, why = corrected(a, runs[2], 10**12, runs[:2])
    # the widest pair (mbs 1 and 8): 10,500,000 / 7 bytes per sample
    assert b.activation_bytes_per_sample == 1_500_000 and "activations" in why
    # recalibrated on the profile's peak: the profile estimate with the new slope still equals it
    assert b.profile_exit_bytes(profile, 1) == 900_000_000 and b.overhead_bytes > model.overhead_bytes
    # another config (other buckets) is not a pair
    other = Experiment("z0_mbs4_b", {**CFG, "train_micro_batch_size_per_gpu": 4, "zero_optimization":
                                     {"stage": 0, "reduce_bucket_size": 1}}, status=Status.OK, peak_memory_bytes=1)
    assert corrected(b, other, 10**12, runs)[0].activation_bytes_per_sample == 1_500_000


# Measured on one H200, GPT-2 124M (vocab 50257, seq 1024, bf16; docs/decisions.md, D204): the first forward
# saves 759 MiB per sample, the whole step grows by 1.12 GiB per sample, plus, at ZeRO-3, the 38.6M-parameter
# embedding gathered and its gradient: 2 * 2 bytes * 38,597,376 = 154,389,504 bytes whatever the mbs.
SAVED = 759 * 2**20  # 795,869,184
GROWTH = 1_202_590_843  # 1.12 GiB
EMBEDDING = 50257 * 768
GATHERED = 2 * 2 * EMBEDDING
GPT2 = {"num_params": 124_439_808, "trainable_num_params": 124_439_808, "activation_mem_per_gpu": 3 * 10**9,
        "activation_saved_bytes": SAVED, "largest_layer_params": EMBEDDING}
BF16_Z3 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


# Measured on one H100 (benchmarks/results/gpu_compare_h100_2026-11-26, examples/train_gpt.py at GPT-2 124M's shape,
# 163,037,184 parameters, bf16): the ZeRO-3 profile at mbs 1 saved 408,881,346 bytes and grew by 651,255,296 over
# forward and backward; ZeRO-0's own steps at mbs 80 and 125 measured 586.25 and 586.35 MiB per sample.
H100_GROWTH, H100_SLOPE = 651_255_296, 614_727_680  # the run's slope: 586.25 MiB


def test_on_cuda_the_activation_term_is_the_steps_growth():
    h100 = {**GPT2, "activation_saved_bytes": 408_881_346, "step_growth_bytes": H100_GROWTH}
    info = ModelInfo.from_metrics(h100, mbs=1, ds_config=BF16_Z3)
    assert info.activation_mem_per_gpu == 651_255_296  # ZeRO-3: nothing subtracted
    assert info.activation_mem_per_gpu / H100_SLOPE == pytest.approx(1.0594, abs=1e-4)  # 6% above, never under
    at2 = ModelInfo.from_metrics({**GPT2, "step_growth_bytes": 2 * GROWTH}, mbs=2, ds_config=BF16_Z3)
    assert at2.activation_mem_per_gpu == 1_202_590_843
    # below stage 3 the constant is the gradient of every trainable parameter: 2 bytes * 124,439,808
    z0 = {**BF16_Z3, "zero_optimization": {"stage": 0}}
    info = ModelInfo.from_metrics({**GPT2, "step_growth_bytes": GROWTH + 248_879_616}, mbs=1, ds_config=z0)
    assert info.activation_mem_per_gpu == 1_202_590_843
    # a growth below the saved storages (a failed measurement) never lowers the term
    assert ModelInfo.from_metrics({**GPT2, "step_growth_bytes": 10}, ds_config=BF16_Z3).activation_mem_per_gpu == SAVED


def test_a_cpu_profile_record_without_the_steps_growth_gives_the_saved_bytes_as_before():
    assert ModelInfo.from_metrics(GPT2, mbs=4).activation_mem_per_gpu == SAVED
    assert ModelInfo.from_metrics(GPT2, mbs=4, ds_config=BF16_Z3).activation_mem_per_gpu == SAVED
    old = {"num_params": 1000, "activation_mem_per_gpu": 4000}  # DeepSpeed's figure alone, at mbs 4
    assert ModelInfo.from_metrics(old, mbs=4).activation_mem_per_gpu == 1000


def test_a_cuda_runs_own_slope_raises_the_activation_term_and_the_estimate_at_another_mbs():
    base, mbs = 3_000_000_000, 8
    streams = step_records({0: [{"step": 1, "base_bytes": 500_000_000, "peak_bytes": base + 11 * 10**9},
                                {"step": 2, "base_bytes": base, "peak_bytes": base + mbs * GROWTH + GATHERED},
                                {"step": 3, "base_bytes": base, "peak_bytes": base + mbs * GROWTH + GATHERED}],
                            1: [{"step": 2, "base_bytes": base, "peak_bytes": base + mbs * GROWTH}]})
    slope = activation_slope_bytes(streams, mbs)
    assert slope == 1_202_590_843 + 19_298_688  # rank 0's last step: the gathered constant over 8 samples
    assert activation_slope_bytes(step_records({0: [{"step": 2, "peak_bytes": 9}]}), mbs) is None  # CPU: no base
    model = MemoryModel(124_439_808, SAVED, 1, largest_layer_params=EMBEDDING)
    cfg = {**BF16_Z3, "train_micro_batch_size_per_gpu": mbs}
    run = Experiment("z3_mbs8", cfg, status=Status.OK, peak_memory_bytes=1, activation_slope_bytes=slope)
    new, why = corrected(model, run, 10**12)
    assert new.activation_bytes_per_sample == 1_221_889_531 and "own step" in why
    at32 = {**cfg, "train_micro_batch_size_per_gpu": 32}
    assert new.bytes_per_device(at32) - model.bytes_per_device(at32) == 32 * (1_221_889_531 - SAVED)
    # the states and buffers (4,086,555,392 B at ZeRO-3 bf16 on one rank), less the reduction's copy made apart
    # from the activations (248,879,616 B), plus 32 samples at the run's own slope
    assert new.bytes_per_device(at32) == 4_086_555_392 - 248_879_616 + 32 * 1_221_889_531 == 42_938_140_768
    # a later run's smaller slope never lowers it: the largest measured so far
    run.activation_slope_bytes = GROWTH
    assert corrected(new, run, 10**12) == (new, None)


def test_a_checkpointed_runs_own_slope_corrects_the_checkpointed_term_and_scales_the_plain_one():
    model = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4,
                        checkpointed_activation_bytes_per_sample=300)
    cfg = {**CFG, "gradient_checkpointing": True}
    run = Experiment("z0_gck_mbs2", cfg, num_slots=4, status=Status.OK, peak_memory_bytes=1, activation_slope_bytes=360)
    new, why = corrected(model, run, 10**12)
    # 360 bytes a sample measured with checkpointing, 1.2 x the modelled 300: the plain term follows, 1,200
    assert (new.checkpointed_activation_bytes_per_sample, new.activation_bytes_per_sample) == (360, 1_200)
    assert "checkpointed activations 360 B per sample (was 300 B" in why
    # below the checkpointed term (not the plain one): nothing learnt
    run.activation_slope_bytes = 350
    assert corrected(new, run, 10**12) == (new, None)
