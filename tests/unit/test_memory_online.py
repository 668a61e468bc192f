"""The memory model checked on every run: the online fit (zerotune/model/online.py) on recorded peak series, the
margin, refused configs in the summary, exp.json's error, the summary's memory table."""
import pytest

from tests.helpers.simulated import tune_simulated
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import activation_slope_bytes
from zerotune.core.units import format_bytes
from zerotune.model.memory import MemoryModel
from zerotune.model.online import OnlineMemory, Reading
from zerotune.model.profile import ModelInfo
from zerotune.probe import step_records
from zerotune.report.results import memory_table, table_text

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 0}}
GiB, MiB = 2**30, 2**20
BUDGET = int(2.5 * GiB)  # make demo's per-rank budget

# make demo's profile run (2026-11-28: examples/train_gpt.py, 5,289,472 parameters, 2 CPU ranks): the ZeRO-3 run at
# mbs 1 saved 10,767,372 bytes per sample and peaked at 517,365,760 bytes of VmData; calibrated, the prior puts
# ZeRO-0 at mbs 64 at 1.12 GiB, as the demo's first run was predicted.
PROFILE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 10_000_000, "stage3_prefetch_bucket_size": 10_000_000,
                                 "stage3_max_live_parameters": 10_000_000},
           "train_batch_size": 2, "autotuning": {"model_info": {"profile": True}}}
PRIOR = MemoryModel(5_289_472, 10_767_372, 2, trainable_params=5_289_472, largest_layer_params=1_048_576,
                    persistent_params=308_736, host_on_device=True).calibrated(PROFILE, 517_365_760, mbs=1)


def demo(stage, mbs, gas=1):
    """The demo's config of ZeRO ``stage`` at ``mbs`` (and ``gas``) on 2 ranks."""
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "train_batch_size": mbs * gas * 2}


def feed(memory, series, budget=BUDGET):
    """Each run's prediction before it ran (what exp.json records), then the model after them all."""
    predicted = []
    for i, (cfg, peak) in enumerate(series):
        predicted.append(memory.bytes_per_device(cfg))
        status = Status.OOM if peak is None else Status.OK
        memory, _ = memory.observed(Experiment(f"run{i}", cfg, num_slots=2, status=status, peak_memory_bytes=peak),
                                    budget)
    return predicted, memory


# make demo's six runs as issue 39 quotes them (ZeRO-0: mbs 64, 32, 48, 40, gas 2 at mbs 40, mbs 40 again), in
# bytes that print as it quotes them
DEMO_RUNS = [(demo(0, 64), 1_632_000_000), (demo(0, 32), 939 * MiB), (demo(0, 48), 1_364_000_000),
             (demo(0, 40), 1_181_000_000), (demo(0, 40, gas=2), 1_288_000_000), (demo(0, 40), 1_170_000_000)]


def test_the_demos_six_peaks_are_fitted_both_ways():
    assert [format_bytes(p) for _, p in DEMO_RUNS] == ["1.52 GiB", "939.00 MiB", "1.27 GiB", "1.10 GiB", "1.20 GiB",
                                                      "1.09 GiB"]
    predicted, memory = feed(OnlineMemory(PRIOR), DEMO_RUNS)
    # the first is the prior's (1.12 GiB); each later one the fit through the runs before it and the prior's point at
    # mbs 1; the replica is its config's measurement (the one-way correction had it at 1.61 GiB, +47.7%)
    assert predicted == [1_198_981_364, 1_067_498_122, 1_322_338_736, 1_192_363_647, 1_190_044_004, 1_181_000_000]
    errors = [round(p / peak - 1, 4) for p, (_, peak) in zip(predicted, DEMO_RUNS)]
    assert errors == [-0.2653, 0.0842, -0.0305, 0.0096, -0.0761, 0.0094]
    # the ratchet's figures were a median |error| of 36.6% and a worst of 47.7%; after the first guess, 3.1% and 8.4%
    assert sorted(abs(e) for e in errors)[2:4] == [0.0305, 0.0761]  # median 5.3%, the prior's first guess included
    line = memory.line(demo(0, 1))
    assert (round(line.slope), round(line.intercept)) == (17_940_817, 399_073_193)
    # each measured config at the mean of its peaks; another mbs on the line
    assert memory.bytes_per_device(demo(0, 40)) == (1_181_000_000 + 1_170_000_000) // 2
    assert memory.bytes_per_device(demo(0, 56)) == 1_488_390_512
    # the margin: the 95th percentile of the six relative residuals (the gas-2 run is 7.8% above the line)
    assert [round(r, 4) for r in memory.residuals] == [0.0001, -0.0752, 0.0152, -0.0182, 0.0776, -0.0281]
    assert round(memory.margin, 4) == 0.062


def test_the_demos_first_guess_from_the_profiles_slope_is_within_the_target():
    # make demo on 2026-11-28 after the CPU profile measured a training step's growth per sample (D111): 14,959,616
    # bytes against the 10,767,372 the forward saves, VmData 603,381,760 after its first backward (the calibration
    # models that state); the six runs' peaks (ZeRO-0 mbs 64, 32, 48, 56, then gas 2 at mbs 32 and 64) as that
    # tuning recorded them
    prior = MemoryModel(5_289_472, 14_959_616, 2, trainable_params=5_289_472, largest_layer_params=1_048_576,
                        persistent_params=308_736, host_on_device=True).calibrated(PROFILE, 603_381_760, mbs=1,
                                                                                   after_backward=True)
    runs = [(demo(0, 64), 1_665_368_064), (demo(0, 32), 1_080_700_928), (demo(0, 48), 1_379_917_824),
            (demo(0, 56), 1_439_588_352), (demo(0, 32, gas=2), 1_173_921_792), (demo(0, 64, gas=2), 1_863_725_056)]
    predicted, memory = feed(OnlineMemory(prior), runs)
    assert predicted == [1_499_639_296, 1_102_480_660, 1_376_721_760, 1_518_613_879, 1_084_266_964, 1_640_584_476]
    errors = [round(p / peak - 1, 4) for p, (_, peak) in zip(predicted, runs)]
    # the first guess -10.0% (it was -26.5% from the saved bytes); the gas-2 runs' heaps hold 8-12% more than the
    # gas-1 line: median 6.6%, worst 12.0% (issue 39's target: 5% and 15%)
    assert errors == [-0.0995, 0.0202, -0.0023, 0.0549, -0.0764, -0.1197]
    assert round(memory.margin, 4) == 0.0868


def test_a_hugging_face_gpt2s_series_is_predicted_as_its_tuning_recorded_it():
    # benchmarks/train_hf_loop.py (transformers' GPT2LMHeadModel, 4 layers of 256, vocab 8192, seq 128) on 2 CPU
    # ranks under 3 GiB, 2026-11-28: the profile record as tune read it, then its eleven runs in order (ZeRO-0 mbs 48
    # out of memory; replicas of ZeRO-1 mbs 10 and ZeRO-0 mbs 47)
    metrics = {"num_params": 5_289_472, "trainable_num_params": 5_289_472, "activation_mem_per_gpu": 46_600_192,
               "activation_saved_bytes": 23_474_188, "largest_layer_params": 2_097_152, "persistent_params": 308_736,
               "data_peak_bytes": 760_639_488, "step_growth_bytes": 57_000_972, "forward_growth_bytes": 37_502_048,
               "slope_bytes": 31_859_712, "data_slope_bytes": 53_524_480, "activation_checkpointed_bytes": 9_705_484}
    info = ModelInfo.from_metrics(metrics, 1_638_830_080, mbs=1, ds_config=PROFILE)
    # VmData's slope (51.0 MiB a sample) over the allocator's (30.4) and the saved bytes (22.4); the peak after the
    # profile's backward, not the backend's, which holds the wider steps
    assert (info.activation_mem_per_gpu, info.peak_memory_bytes, info.peak_after_backward) == (53_524_480, 760_639_488,
                                                                                              True)
    prior = MemoryModel(info.num_params, info.activation_mem_per_gpu, 2, trainable_params=info.trainable_num_params,
                        largest_layer_params=info.largest_layer_params, persistent_params=info.persistent_params,
                        host_on_device=True).calibrated(PROFILE, info.peak_memory_bytes, mbs=1, after_backward=True)
    runs = [(demo(0, 47), 3_136_458_752), (demo(0, 48), None), (demo(0, 23), 1_721_171_968), (demo(1, 10), 3_000_119_296),
            (demo(1, 10), 2_959_261_696), (demo(0, 47), 3_071_381_504), (demo(2, 10), 3_019_771_904),
            (demo(3, 9), 3_176_247_296), (demo(0, 35), 2_509_307_904), (demo(0, 41), 2_727_981_056),
            (demo(0, 35, gas=2), 2_535_002_112)]
    predicted, memory = feed(OnlineMemory(prior), runs, budget=3 * GiB)
    # exactly the predictions the tuning's exp.json files recorded
    assert predicted == [3_182_765_568, 3_188_976_562, 1_890_769_500, 3_213_063_760, 3_000_119_296, 3_136_458_752,
                         3_085_949_133, 3_017_096_366, 2_509_509_900, 2_837_987_894, 2_506_220_668]
    errors = sorted(abs(p / peak - 1) for p, (_, peak) in zip(predicted, runs) if peak is not None)
    # ten runs measured to their peak: the middle two 2.12% and 2.19% (the summary's median 2.2%), the worst 9.85%
    assert [round(e, 4) for e in errors[4:6]] + [round(errors[-1], 4)] == [0.0212, 0.0219, 0.0985]
    assert round(errors[0], 4) == 0.0001 and round(memory.margin, 4) == 0.0176


def test_a_stage_without_a_run_takes_the_fitted_slope_and_is_refused_with_its_prediction_and_the_margin():
    _, memory = feed(OnlineMemory(PRIOR), DEMO_RUNS)
    # ZeRO-0's fitted slope is 1.666x the profile's: ZeRO-1, never run, turns the prior's line about its point at
    # mbs 1 by as much (the prior alone puts mbs 16 at 2.50 GiB)
    assert round(memory.slope_ratio, 4) == 1.6662
    assert OnlineMemory(PRIOR).bytes_per_device(demo(1, 16)) == 2_682_147_508
    assert memory.bytes_per_device(demo(1, 16)) == 2_789_749_187
    assert memory.guarded_bytes(demo(1, 16)) == 2_833_466_682  # the line's part raised by the 6.2% margin
    assert memory.refusal(demo(1, 16), BUDGET) == ("not launched: predicted 2.60 GiB per rank, 2.64 GiB with the 6.2% "
                                                   "margin, over the 2.50 GiB budget")
    assert [memory.max_mbs(demo(stage, 1), BUDGET, cap=64) for stage in (1, 2, 3)] == [8, 8, 7]
    assert memory.refusal(demo(1, 8), BUDGET) is None and memory.refusal(demo(1, 9), BUDGET) is not None
    assert memory.refusal(demo(0, 40), BUDGET) is None  # measured: never refused


def test_heap_noise_averages_out_and_a_lower_peak_lowers_the_fit():
    # one config measured 874 and 812 MiB (glibc's heap), as on a Hugging Face GPT-2 on 2 CPU ranks; the one-way
    # correction predicted the second at 1.18 GiB (+48.7%)
    series = [(demo(0, 16), 1_267_000_000), (demo(0, 8), 874 * MiB), (demo(0, 8), 812 * MiB)]
    predicted, memory = feed(OnlineMemory(PRIOR), series)
    assert predicted == [682_147_508, 868_939_695, 874 * MiB]  # the replica at its config's measurement
    assert memory.bytes_per_device(demo(0, 8)) == 843 * MiB  # then at the mean of the two
    # the lower replica lowers the line too: mbs 32 from 1.93 GiB after 874 MiB to 1.93 GiB less 6.6 MB after 812
    _, two = feed(OnlineMemory(PRIOR), series[:2])
    assert (two.bytes_per_device(demo(0, 32)), memory.bytes_per_device(demo(0, 32))) == (2_075_632_148, 2_069_044_684)
    assert round(memory.margin, 4) == 0.0449


def test_an_out_of_memory_run_bounds_the_fit_from_below():
    memory = OnlineMemory(PRIOR)
    assert memory.bytes_per_device(demo(1, 16)) == 2_682_147_508 <= BUDGET  # the prior: it fits, it is launched
    (_,), memory = feed(memory, [(demo(1, 16), None)])
    # its peak was over the budget: the line now meets budget + 1 there, turned about the prior's point
    assert memory.bytes_per_device(demo(1, 16)) == BUDGET + 1
    assert memory.bytes_per_device(demo(1, 12)) == 2_640_696_526
    assert memory.max_mbs(demo(1, 1), BUDGET, cap=64) == 15
    assert memory.refusal(demo(1, 16), BUDGET) == ("not launched: predicted 2.50 GiB per rank (margin 0%), over the "
                                                   "2.50 GiB budget")
    # a peak at mbs 8 under the line would lower it; the bound holds it at budget + 1 at mbs 16
    _, memory = feed(memory, [(demo(1, 8), 2_300_000_000)])
    assert memory.bytes_per_device(demo(1, 16)) == BUDGET + 1
    assert memory.bytes_per_device(demo(1, 12)) == 2_607_806_451


def test_a_family_is_a_stage_with_its_precision_and_savers_and_the_checkpointed_one_takes_the_plain_ones_ratio():
    model = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4,
                        checkpointed_activation_bytes_per_sample=300)
    memory = OnlineMemory(model)
    plain, checkpointed = CFG, {**CFG, "gradient_checkpointing": True}
    # the plain family measures 2,000 bytes per sample (twice the profile's) at mbs 2 and 10, on a line through the
    # prior's point (1,000 bytes over the structural terms at mbs 1)
    _, memory = feed(memory, [(plain, memory.structural_bytes(plain, 2) + 3_000),
                              ({**plain, "train_micro_batch_size_per_gpu": 10}, memory.structural_bytes(plain, 10) + 19_000)])
    assert round(memory.line(plain).slope) == 2_000 and round(memory.slope_ratio, 3) == 2.0
    # checkpointing, never run: the prior's 300 bytes per sample doubled, about the prior's point at mbs 1 (300 B)
    line = memory.line(checkpointed)
    assert (round(line.slope), round(line.intercept)) == (600, -300)
    assert memory.bytes_per_device({**checkpointed, "train_micro_batch_size_per_gpu": 8}) == (
        memory.structural_bytes(checkpointed, 8) + 8 * 600 - 300)


def test_what_a_run_teaches():
    ok = Experiment("a", CFG, status=Status.OK, peak_memory_bytes=5)
    assert Reading.of(ok, 100) == Reading(CFG, 2, 5)
    assert Reading.of(Experiment("b", CFG, status=Status.OOM), 100) == Reading(CFG, 2, 101, bound=True)
    # the profile run is the prior's own calibration; a failure, a run without a peak and a refusal teach nothing
    assert Reading.of(Experiment("p", CFG, kind=ExperimentKind.PROFILE, status=Status.OK, peak_memory_bytes=5), 1) is None
    for status in (Status.FAILED, Status.REFUSED, Status.SKIPPED, Status.OK):
        assert Reading.of(Experiment("c", CFG, status=status), 100) is None
    memory = OnlineMemory(PRIOR)
    assert memory.observed(Experiment("f", CFG, status=Status.FAILED), 100) == (memory, None)


def test_the_summary_says_a_refused_config_was_not_launched_with_its_prediction(tmp_path):
    # SIMULATED scenario 3 (GPT-125M on 128 A100-80GB): ZeRO-0 runs out of memory at its estimate and is deferred;
    # ZeRO-1 is searched; the fit then puts ZeRO-2 and ZeRO-3 at mbs 71 over the 80 GiB budget: never launched, so
    # never an OOM and never "probed"
    tune_simulated(tmp_path, 3, True, "all")
    summary = " ".join((tmp_path / "r" / "summary.txt").read_text().split())
    assert ("ZeRO stage 2: not launched - probe at mbs=71 not launched: predicted 87.66 GiB per rank, 88.26 GiB "
            "with the 0.7% margin, over the 80.00 GiB budget; probe at mbs=53: skipped") in summary
    assert ("z2_gas1_tmbspg71_fp1: not launched: predicted 87.66 GiB per rank, 88.26 GiB with the 0.7% margin, over "
            "the 80.00 GiB budget") in summary
    assert "margin 0.7%: the 95% quantile of the fit's relative residuals over 2 peak(s)" in summary
    assert "ZeRO stage 2: probed" not in summary and "mbs=71: oom" not in summary


def exp(status, peak=None):
    return Experiment("z0_mbs2", CFG, num_slots=4, status=status, peak_memory_bytes=peak)


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
    # an OOM run's peak is where it failed, under its true peak: shown, never scored
    oom = Experiment("e", CFG, status=Status.OOM, peak_memory_bytes=500)
    oom.memory_bytes = 1_000
    text = table_text(memory_table(runs + [oom]))
    assert "over the budget" in text and "+100.0%" not in text
    assert "3 runs: median |error| 10.0%, worst 10.0% (1 out of memory left out" in text
    assert "no run measured to its peak (1 out of memory left out" in table_text(memory_table([oom]))


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


def test_on_cpu_the_activation_term_is_the_profiles_slope_and_its_peak_the_probes():
    # the demo's ZeRO-3 profile (examples/train_gpt.py, 2 CPU ranks): 10,767,372 bytes saved at mbs 1; the
    # training micro steps at mbs 2, 4 and 8 peaked 59,391,832, 79,762,448 and 139,600,912 bytes over their start
    demo = {"num_params": 5_289_472, "activation_saved_bytes": 10_767_372, "data_peak_bytes": 595_378_176,
            "step_growth_bytes": 48_748_556, "slope_bytes": 14_959_616}
    info = ModelInfo.from_metrics(demo, peak_memory_bytes=812_818_432, ds_config={"zero_optimization": {"stage": 3}})
    assert info.activation_mem_per_gpu == 14_959_616  # (139,600,912 - 79,762,448) / 4, over the saved bytes
    # the backend's sampled peak holds the wider steps: the probe's, taken before them, calibrates
    assert info.peak_memory_bytes == 595_378_176
    # a slope under the saved bytes never lowers the term
    assert ModelInfo.from_metrics({**demo, "slope_bytes": 5}).activation_mem_per_gpu == 10_767_372
    # VmData's rise per sample over the widest steps (8x to 16x: 844,312,576 to 978,804,736 bytes, 8 samples), what
    # the CPU budget limits, where it is larger: the heap keeps more than the allocator's live bytes
    assert ModelInfo.from_metrics({**demo, "data_slope_bytes": 16_811_520}).activation_mem_per_gpu == 16_811_520
    assert info.peak_after_backward  # the calibration models the state after the first backward
    # without a slope (the wider steps failed), a CPU record's step growth at mbs 1 is not read: 48.7 MB there is
    # mostly the gradients and the parameters ZeRO-3 gathers; the saved bytes stay
    no_slope = {k: v for k, v in demo.items() if k != "slope_bytes"}
    info = ModelInfo.from_metrics(no_slope, peak_memory_bytes=812_818_432, ds_config={"zero_optimization": {"stage": 3}})
    assert (info.activation_mem_per_gpu, info.peak_memory_bytes) == (10_767_372, 595_378_176)
    # without the backward (no loss found), the forward's peak: the larger of the probe's and the backend's
    forward_only = {k: v for k, v in no_slope.items() if k != "step_growth_bytes"}
    info = ModelInfo.from_metrics(forward_only, peak_memory_bytes=812_818_432)
    assert (info.peak_memory_bytes, info.peak_after_backward) == (812_818_432, False)


def test_a_cuda_run_records_its_own_steps_growth_per_sample():
    # recorded in exp.json (activation_slope_bytes); the fit reads the peaks themselves (docs/decisions.md, D110)
    base, mbs = 3_000_000_000, 8
    streams = step_records({0: [{"step": 1, "base_bytes": 500_000_000, "peak_bytes": base + 11 * 10**9},
                                {"step": 2, "base_bytes": base, "peak_bytes": base + mbs * GROWTH + GATHERED},
                                {"step": 3, "base_bytes": base, "peak_bytes": base + mbs * GROWTH + GATHERED}],
                            1: [{"step": 2, "base_bytes": base, "peak_bytes": base + mbs * GROWTH}]})
    slope = activation_slope_bytes(streams, mbs)
    assert slope == 1_202_590_843 + 19_298_688  # rank 0's last step: the gathered constant over 8 samples
    assert activation_slope_bytes(step_records({0: [{"step": 2, "peak_bytes": 9}]}), mbs) is None  # CPU: no base


def test_one_out_of_memory_run_moves_every_stages_prediction():
    memory = OnlineMemory(PRIOR)
    before = [memory.bytes_per_device(demo(stage, 16)) for stage in range(4)]
    assert before == [682_147_508, 2_682_147_508, 2_671_568_564, 2_703_305_396]
    (_,), memory = feed(memory, [(demo(1, 16), None)])
    # ZeRO-1 at mbs 16 ran out of memory: its line meets the budget there, 1.37% steeper than the profile's, and
    # ZeRO-0, 2 and 3, never run, take the same slope ratio: each moves by the same 2,207,053 bytes at mbs 16
    assert round(memory.slope_ratio, 4) == 1.0137
    after = [memory.bytes_per_device(demo(stage, 16)) for stage in range(4)]
    assert after == [684_354_561, BUDGET + 1, 2_673_775_617, 2_705_512_449]
    assert {a - b for a, b in zip(after, before)} == {2_207_053}
    # ZeRO-2's largest admitted mbs falls from 17 to 16: the run it would have bought at 17 is never launched
    assert [OnlineMemory(PRIOR).max_mbs(demo(s, 1), BUDGET, cap=64) for s in range(4)] == [64, 16, 17, 14]
    assert [memory.max_mbs(demo(s, 1), BUDGET, cap=64) for s in range(4)] == [64, 15, 16, 14]
