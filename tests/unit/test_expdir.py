"""Tests for zerotune.run.expdir: the experiment directory's files, read and written exactly."""
import json
import math
import statistics
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import OBJECTIVES
from zerotune.model.profile import ModelInfo
from zerotune.run import expdir

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
ALLOCATOR_OOM = ("RuntimeError: [enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 2000000000 bytes. Error code 12 (Cannot allocate memory)")


def exp(kind: ExperimentKind = ExperimentKind.MBS) -> Experiment:
    return Experiment("z1_mbs2_gas1", json.loads(json.dumps(CONFIG)), num_slots=2, kind=kind)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_prepare_writes_the_autotuning_section_with_paths_in_the_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = exp()
    write(tmp_path / "exps" / "a" / "metrics.json", '{"throughput": 99.0}')  # from an earlier attempt
    write(tmp_path / "exps" / "a" / "model_info.json", '{"num_params": 1}')
    path = expdir.prepare(e, Path("exps/a"), OBJECTIVES["latency"], start_profile_step=2, end_profile_step=4)

    d = tmp_path / "exps" / "a"
    assert path == d / "ds_config.json"
    assert json.loads(path.read_text()) == {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "autotuning": {"enabled": True, "metric_path": str(d / "metrics.json"),
                       "model_info_path": str(d / "model_info.json"), "start_profile_step": 2,
                       "end_profile_step": 4, "metric": "latency"}}
    assert sorted(p.name for p in d.iterdir()) == ["ds_config.json"]  # stale results removed
    assert e.ds_config == CONFIG  # the experiment's own config is untouched
    e.pad_seq_len = 1024  # --verify-longest: the probe pads every batch to the length this file holds
    expdir.prepare(e, Path("exps/a"), OBJECTIVES["latency"], start_profile_step=2, end_profile_step=4)
    assert (d / "pad_seq_len.txt").read_text() == "1024\n"
    e.pad_seq_len = None  # a later attempt without it leaves no pad file behind
    expdir.prepare(e, Path("exps/a"), OBJECTIVES["latency"], start_profile_step=2, end_profile_step=4)
    assert sorted(p.name for p in d.iterdir()) == ["ds_config.json"]


def test_finish_converts_latency_microseconds_to_seconds(tmp_path):
    write(tmp_path / "metrics.json", '{"latency": 250000, "throughput": 8.0, "FLOPS_per_gpu": 1e9}')
    write(tmp_path / "stderr.log", "UserWarning: an error-free error message\n")
    done = expdir.finish(exp(), tmp_path, OBJECTIVES["latency"], exit_code=0)
    assert (done.status, done.error, done.exit_code) == (Status.OK, "", 0)
    assert done.metric == 0.25
    assert done.metrics == {"latency": 250000, "throughput": 8.0, "FLOPS_per_gpu": 1e9}


def test_finish_of_the_profile_run_reads_model_info_and_scores_nothing(tmp_path):
    info = {"num_params": 124_439_808, "trainable_num_params": 124_439_808, "activation_mem_per_gpu": 50_331_648}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "metrics.json", '{"throughput": 5.0}')  # not the profile run's result
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (done.status, done.error, done.metric, done.metrics) == (Status.OK, "", None, info)


def test_finish_of_the_profile_run_adds_the_probes_saved_activations_per_sample(tmp_path):
    info = {"num_params": 14_727_168, "trainable_num_params": 14_727_168, "activation_mem_per_gpu": 54_505_472}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "activations.json", '{"saved_bytes": 13122584, "saved_storages": 61, "micro_batch_size": 2}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics == {**info, "activation_saved_bytes": 6_561_292}
    assert ModelInfo.from_metrics(done.metrics, mbs=2).activation_mem_per_gpu == 6_561_292  # per sample already
    assert ModelInfo.from_metrics(info, mbs=2).activation_mem_per_gpu == 27_252_736  # DeepSpeed's, over 2 samples


def test_with_activation_checkpointing_the_per_sample_bytes_add_the_largest_recomputed_region(tmp_path):
    # what the backward pass holds at its peak: every region's saved input, plus the region it recomputes
    info = {"num_params": 14_727_168, "trainable_num_params": 14_727_168, "activation_mem_per_gpu": 9_000_000}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "activations.json", '{"saved_bytes": 1048576, "recompute_bytes": 5767168, "recompute_regions": 4, '
                                         '"micro_batch_size": 2}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics == {**info, "activation_saved_bytes": 3_407_872}  # (1048576 + 5767168) / 2


def test_the_profile_run_carries_the_probes_price_of_checkpointing_per_sample(tmp_path):
    info = {"num_params": 14_727_168, "trainable_num_params": 14_727_168, "activation_mem_per_gpu": 54_505_472}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "activations.json", '{"saved_bytes": 13122584, "checkpointed_bytes": 4000001, '
                                         '"checkpoint_layers": 6, "micro_batch_size": 2}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics == {**info, "activation_saved_bytes": 6_561_292, "activation_checkpointed_bytes": 2_000_000}
    model = ModelInfo.from_metrics(done.metrics, mbs=2)
    assert (model.activation_mem_per_gpu, model.checkpointed_activation_mem_per_gpu) == (6_561_292, 2_000_000)
    # on CUDA the step's growth raises the plain term to 7,000,000 bytes a sample: the 438,708 bytes the backward
    # allocates on top of the saved ones (at ZeRO-3 no constant) are there with checkpointing too
    cuda = ModelInfo.from_metrics({**done.metrics, "step_growth_bytes": 14_000_000}, mbs=2,
                                  ds_config={"zero_optimization": {"stage": 3}})
    assert (cuda.activation_mem_per_gpu, cuda.checkpointed_activation_mem_per_gpu) == (7_000_000, 2_438_708)
    assert ModelInfo.from_metrics(info).checkpointed_activation_mem_per_gpu is None
    write(tmp_path / "activations.json", '{"saved_bytes": 100, "checkpointed_bytes": -1, "micro_batch_size": 1}')
    assert "activation_checkpointed_bytes" not in expdir.finish(exp(ExperimentKind.PROFILE), tmp_path,
                                                                OBJECTIVES["throughput"], exit_code=0).metrics


def test_finish_of_the_profile_run_adds_the_probes_model_shapes(tmp_path):
    info = {"num_params": 14_727_168, "trainable_num_params": 14_727_168, "activation_mem_per_gpu": 54_505_472}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "activations.json", '{"saved_bytes": 100, "micro_batch_size": 1, "largest_layer_params": 4194304, '
                                         '"persistent_params": true}')  # a bool is not a count: left out
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics == {**info, "activation_saved_bytes": 100, "largest_layer_params": 4_194_304}
    model = ModelInfo.from_metrics(done.metrics)
    assert (model.largest_layer_params, model.persistent_params, model.peak_memory_bytes) == (4_194_304, 0, None)


def test_on_cuda_the_profile_peak_is_the_probes_device_peak(tmp_path):
    write(tmp_path / "model_info.json", '{"num_params": 1000}')
    write(tmp_path / "activations.json", '{"saved_bytes": 10, "device_peak_bytes": 5000000000}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert ModelInfo.from_metrics(done.metrics).peak_memory_bytes == 5_000_000_000  # calibrates on CUDA
    # the local backend's sampled peak is the ranks' host VmData: on CUDA the device's figure wins over it
    assert ModelInfo.from_metrics(done.metrics, 7).peak_memory_bytes == 5_000_000_000
    # on CPU the probe writes no device peak: the backend's sampled peak calibrates, or rank 0's 5 ms VmData
    # peak from the profile record where it is larger (the first forward's peak may fall between two samples)
    assert ModelInfo.from_metrics({"num_params": 1000}, 7).peak_memory_bytes == 7
    assert ModelInfo.from_metrics({"num_params": 1000, "data_peak_bytes": 9}, 7).peak_memory_bytes == 9
    assert ModelInfo.from_metrics({"num_params": 1000, "data_peak_bytes": 5}, 7).peak_memory_bytes == 7
    assert ModelInfo.from_metrics({"num_params": 1000}).peak_memory_bytes is None


def test_on_cpu_the_profile_record_carries_rank_0s_vmdata_peak_to_the_calibration(tmp_path):
    write(tmp_path / "model_info.json", '{"num_params": 1000}')
    write(tmp_path / "activations.json", '{"saved_bytes": 10, "data_peak_bytes": 600000000}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics["data_peak_bytes"] == 600_000_000
    assert ModelInfo.from_metrics(done.metrics, 550_000_000).peak_memory_bytes == 600_000_000


@pytest.mark.parametrize("record", ['{"saved_bytes": -1}', '{"saved_bytes": 5, "micro_batch_size": 0}',
                                    '{"saved_bytes": true}', '{"saved_bytes": 5, "recompute_bytes": -1}',
                                    '[1]', 'not json'])
def test_a_bad_activations_record_is_ignored(tmp_path, record):
    info = {"num_params": 10, "activation_mem_per_gpu": 4}
    write(tmp_path / "model_info.json", json.dumps(info))
    write(tmp_path / "activations.json", record)
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert done.metrics == info


def test_an_activations_record_beside_a_failed_or_non_profile_run_is_not_read(tmp_path):
    write(tmp_path / "activations.json", '{"saved_bytes": 100}')
    write(tmp_path / "metrics.json", '{"throughput": 5.0}')
    assert "activation_saved_bytes" not in expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0).metrics
    failed = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path / "none", OBJECTIVES["throughput"], exit_code=1)
    assert failed.metrics == {}


def test_finish_takes_the_metric_and_peak_from_the_probe_and_keeps_deepspeeds_for_comparison(tmp_path):
    ds_metrics = {"latency": 150000, "throughput": 106.7, "FLOPS_per_gpu": 1e9}
    write(tmp_path / "metrics.json", json.dumps(ds_metrics))
    for rank, times in ((0, [0.9, 0.15, 0.16, 0.15]), (1, [0.8, 0.16, 0.15, 0.17])):
        lines = [{"rank": rank, "step": i, "t": 10.0 + i, "step_s": s, "micro_steps": 1, "train_batch_size": 16,
                  "peak_bytes": (rank + 1) * 10**9} for i, s in enumerate(times, start=1)]
        write(tmp_path / f"probe.rank{rank}.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines))
    e = exp()
    e.peak_memory_bytes = 5 * 10**8  # the backend's sampler

    done = expdir.finish(e, tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (done.status, done.metric_source, done.metrics) == (Status.OK, "probe", ds_metrics)
    assert done.metric == pytest.approx(16 / ((0.16 + 0.16 + 0.17) / 3), abs=1e-9)  # slowest rank per step
    t_975_2, s = 4.302652729749464, statistics.stdev([0.16, 0.16, 0.17])
    assert done.metric_rel_half_width == pytest.approx(t_975_2 * s / math.sqrt(3) / ((0.16 + 0.16 + 0.17) / 3),
                                                       abs=1e-9)
    assert done.peak_memory_bytes == 2 * 10**9

    flops = expdir.finish(exp(), tmp_path, OBJECTIVES["flops"], exit_code=0)  # not measured by the probe
    assert (flops.metric, flops.metric_source, flops.metric_rel_half_width) == (1e9, "deepspeed", None)
    for path in tmp_path.glob("probe.rank*.jsonl"):
        path.unlink()
    plain = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)  # no streams: SIMULATED
    assert (plain.metric, plain.metric_source, plain.peak_memory_bytes) == (106.7, "deepspeed", None)


def test_finish_says_a_garbage_metrics_file_is_invalid(tmp_path):
    write(tmp_path / "metrics.json", '{"throughput": 12.')
    done = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (done.status, done.metric, done.metrics) == (Status.FAILED, None, {})
    assert done.error == "metrics.json is invalid: not JSON (Expecting ',' delimiter: line 1 column 18 (char 17))"
    write(tmp_path / "metrics.json", "[1, 2]")
    assert expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0).error == \
        "metrics.json is invalid: a JSON list, not an object"


def test_finish_names_the_missing_result_file(tmp_path):
    done = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (done.status, done.error) == (
        Status.FAILED, "exited 0 without writing metrics.json (does the script run more than end_profile_step steps?)")
    profile = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert profile.error == ("exited 0 without writing model_info.json "
                             "(does the script run a forward step through the DeepSpeed engine?)")


def test_finish_classifies_the_allocator_message_as_oom(tmp_path):
    write(tmp_path / "stdout.log", "[rank0] step 1\n")
    write(tmp_path / "stderr.log", f"Traceback (most recent call last):\n  ...\n{ALLOCATOR_OOM}\n")
    done = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=1)
    assert (done.status, done.error, done.exit_code, done.metric) == (Status.OOM, ALLOCATOR_OOM, 1, None)


def test_openmp_failing_to_map_a_thread_stack_is_oom_and_a_thread_limit_message_elsewhere_is_not(tmp_path):
    # 2 CPU ranks under RLIMIT_DATA near their peak (D334): the rank's last words, after its step-1 line
    gomp = "libgomp: Thread creation failed: Resource temporarily unavailable"
    write(tmp_path / "stderr.log", f"step 1 loss 7.1687\n\n{gomp}\n")
    done = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=1)
    assert (done.status, done.error) == (Status.OOM, gomp)
    write(tmp_path / "stderr.log", "warning: libgomp: Thread creation failed: Resource temporarily unavailable\n")
    assert expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=1).status is Status.FAILED


def test_finish_without_a_result_is_a_failure_with_the_last_error_line_or_a_timeout(tmp_path):
    write(tmp_path / "stderr.log", "Traceback (most recent call last):\nValueError: bad shape\n"
                                   "[launch.py:325:sigkill_handler] Killing subprocess 4242\n")
    failed = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=1)
    assert (failed.status, failed.error) == (Status.FAILED, "exit code 1: ValueError: bad shape")
    timeout = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=-15, timed_out=True)
    assert (timeout.status, timeout.error) == (Status.TIMEOUT, "killed after the timeout")
    stopped = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=-15, interrupted=True)
    assert (stopped.status, stopped.error) == (Status.INTERRUPTED, "the tuner was interrupted")


def test_a_non_finite_or_boolean_metric_is_not_a_result(tmp_path):
    for text in ('{"throughput": Infinity}', '{"throughput": true}', '{"throughput": 0}'):
        write(tmp_path / "metrics.json", text)
        done = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)
        assert (done.status, done.error, done.metric) == (Status.FAILED, "metrics.json has no positive 'throughput'",
                                                          None)


def test_output_bytes_counts_both_logs(tmp_path):
    assert expdir.output_bytes(tmp_path) == 0
    write(tmp_path / "stdout.log", "12345")
    write(tmp_path / "stderr.log", "678")
    assert expdir.output_bytes(tmp_path) == 8


def test_on_cuda_the_profile_record_carries_the_steps_growth_and_a_run_its_own_slope(tmp_path):
    write(tmp_path / "p" / "model_info.json", '{"num_params": 1000}')
    write(tmp_path / "p" / "activations.json", '{"saved_bytes": 10, "micro_batch_size": 2, "step_growth_bytes": 900, '
                                               '"forward_growth_bytes": 700}')
    done = expdir.finish(exp(ExperimentKind.PROFILE), tmp_path / "p", OBJECTIVES["throughput"], exit_code=0)
    assert (done.metrics["step_growth_bytes"], done.metrics["forward_growth_bytes"]) == (900, 700)
    assert done.activation_slope_bytes is None  # the profile run has no steps
    write(tmp_path / "r" / "metrics.json", '{"throughput": 10.0, "latency": 1000}')
    mbs = CONFIG["train_micro_batch_size_per_gpu"]
    for rank, peak in ((0, 7_000), (1, 9_000)):  # rank 1's step 2 grew the most: (9,000 - 1,000) / mbs
        lines = [{"rank": rank, "step": i, "t": 10.0 + i, "step_s": 0.1, "micro_steps": 1, "train_batch_size": 4,
                  "peak_bytes": peak, "base_bytes": 100 if i == 1 else 1_000} for i in (1, 2)]
        write(tmp_path / "r" / f"probe.rank{rank}.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines))
    run = expdir.finish(exp(), tmp_path / "r", OBJECTIVES["throughput"], exit_code=0)
    assert run.activation_slope_bytes == 8_000 // mbs and Experiment.from_json(run.to_json()) == run
    assert run.max_seq_len_seen is None  # the lines of a probe that did not record batches


def test_the_record_keeps_the_longest_sequence_a_batch_of_the_run_held_and_an_older_record_still_loads(tmp_path):
    write(tmp_path / "metrics.json", '{"throughput": 10.0, "latency": 1000}')
    for rank, seq_lens in ((0, (128, 512, 256)), (1, (128, 128, 300))):
        lines = [{"rank": rank, "step": i, "t": 10.0 + i, "step_s": 0.1, "micro_steps": 1, "train_batch_size": 4,
                  "batch_samples": 2, "seq_len": n} for i, n in enumerate(seq_lens, start=1)]
        write(tmp_path / f"probe.rank{rank}.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines))
    run = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert run.max_seq_len_seen == 512 and run.to_json()["max_seq_len_seen"] == 512
    assert run.min_seq_len_seen == 128  # the steps' longest: 128, 512, 300: the lengths vary
    assert Experiment.from_json(run.to_json()) == run
    older = {k: v for k, v in run.to_json().items() if k != "max_seq_len_seen"}  # an exp.json written before it
    assert Experiment.from_json(older).max_seq_len_seen is None


def test_a_longer_batch_at_step_1_is_not_the_seen_one_its_peak_lacks_the_optimizer_states(tmp_path):
    write(tmp_path / "metrics.json", '{"throughput": 10.0, "latency": 1000}')
    lines = [{"rank": 0, "step": i, "t": 10.0 + i, "step_s": 0.1, "micro_steps": 1, "train_batch_size": 4,
              "batch_samples": 2, "seq_len": n, "peak_bytes": 1_000 + i} for i, n in ((1, 512), (2, 128), (3, 300))]
    write(tmp_path / "probe.rank0.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines))
    run = expdir.finish(exp(), tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (run.max_seq_len_seen, run.min_seq_len_seen) == (300, 128)  # step 1's 512 is left out of the longest


def test_a_ulysses_config_whose_engine_ran_without_a_sequence_parallel_group_fails_naming_the_key(tmp_path):
    # DeepSpeed counts sequence_parallel_size 2's ranks as one replica (train_batch_size 2 at mbs 2 on 2 ranks)
    # even where the script passed no mpu and each rank trained whole sequences: samples/s half the truth (D336)
    write(tmp_path / "metrics.json", json.dumps({"throughput": 10.0}))
    ulysses = Experiment("z1_gas1_tmbspg2_sp2", {**CONFIG, "sequence_parallel_size": 2}, num_slots=2)
    write(tmp_path / "engine_config.json", json.dumps({"sequence_parallel_size": 1}))
    done = expdir.finish(ulysses, tmp_path, OBJECTIVES["throughput"], exit_code=0)
    assert (done.status, done.metric) == (Status.FAILED, None)
    assert done.error.startswith("sequence_parallel_size 2: the script's DeepSpeed engine ran with a sequence-parallel "
                                 "group of 1: the script does not take Ulysses")
    write(tmp_path / "engine_config.json", json.dumps({"sequence_parallel_size": 2}))  # the script's mpu: measured
    ok = Experiment("z1_gas1_tmbspg2_sp2", {**CONFIG, "sequence_parallel_size": 2}, num_slots=2)
    assert expdir.finish(ok, tmp_path, OBJECTIVES["throughput"], exit_code=0).status is Status.OK


def test_a_ulysses_degree_the_models_heads_do_not_take_is_refused_naming_the_key_and_deepspeeds_reason(tmp_path):
    # what a rank prints when UlyssesSPAttentionHF refuses the degree (3 heads, sp 2)
    write(tmp_path / "stderr.log", "[rank1]: Traceback (most recent call last):\n"
          "[rank1]:   File \"/x/ulysses_sp.py\", line 148, in __init__\n"
          "[rank1]: ValueError: Attention head count 3 is not divisible by SP size 2\n"
          "subprocess.CalledProcessError: Command '['python', '-u', 'train.py']' returned non-zero exit status 1.\n")
    ulysses = Experiment("profile_z1_gas1_tmbspg1_sp2", {**CONFIG, "sequence_parallel_size": 2}, num_slots=2,
                         kind=ExperimentKind.PROFILE)
    done = expdir.finish(ulysses, tmp_path, OBJECTIVES["throughput"], exit_code=1)
    assert done.status is Status.FAILED
    assert expdir.ulysses_refused(done, tmp_path) == (
        "sequence_parallel_size 2: DeepSpeed's Ulysses refused the model: Attention head count 3 is not divisible by "
        "SP size 2: list only degrees that divide its attention heads (and its key/value heads, or that they divide)")
    write(tmp_path / "stderr.log", "[rank0]: ValueError: KV attention head count 3 is not divisible by SP size 2 or "
          "vice versa\n")
    assert "refused the model: KV attention head count 3 is not divisible by SP size 2 or vice versa: list" in (
        expdir.ulysses_refused(expdir.finish(ulysses, tmp_path, OBJECTIVES["throughput"], exit_code=1), tmp_path))
    # a failure for another reason is no refusal of the degree
    write(tmp_path / "stderr.log", "[rank0]: RuntimeError: Attention head count 3 is odd\n")
    assert expdir.ulysses_refused(expdir.finish(ulysses, tmp_path, OBJECTIVES["throughput"], exit_code=1),
                                  tmp_path) is None
