"""The SIMULATED cluster of benchmarks/simcluster pinned to exact values (no process, no e2e)."""
import json

import pytest

from benchmarks.simcluster.backend import SimulatedBackend
from benchmarks.simcluster.model import Cluster, Simulator, ZeroSettings, model_state_bytes
from benchmarks.simcluster.scenarios import (
    A100_40,
    ETH_100G,
    GPT_1_3B,
    GPT_2_7B,
    GPT_125M,
    LLAMA_70B,
    NONE,
    IB_8x200G,
    ROCE_4x100G,
)
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.launch import Node, Reservation
from zerotune.core.measure import measure
from zerotune.core.objective import Objective
from zerotune.probe import read_streams

ONE_NODE = Cluster(A100_40, num_nodes=1, interconnect=NONE)


def zero(stage, **kw):
    return ZeroSettings.from_config({"zero_optimization": {"stage": stage, **kw}})


def test_model_states_match_the_zero_paper_example():
    # Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB,
    # plus DeepSpeed's fp32 gradient partition 4*Psi/N = 468,750,000 bytes (stages 1-3).
    psi, n, fp32_grad = 7_500_000_000, 64, 468_750_000
    assert model_state_bytes(zero(0), psi, n) == (15e9, 15e9, 90e9)
    assert sum(model_state_bytes(zero(1), psi, n)) - fp32_grad == 31_406_250_000
    assert sum(model_state_bytes(zero(2), psi, n)) - fp32_grad == 16_640_625_000
    assert sum(model_state_bytes(zero(3, stage3_max_live_parameters=0), psi, n)) - fp32_grad == 1_875_000_000
    # offload_optimizer moves the optimizer states and the fp32 gradient partition to the host
    assert model_state_bytes(zero(2, offload_optimizer={"device": "cpu"}), psi, n) == (15e9, 234_375_000, 0)


def test_zero3_memory_on_eight_gpus():
    sim = Simulator(GPT_1_3B, ONE_NODE)
    assert GPT_1_3B.num_params == 1_310_885_888  # 24 * 12 * 2048^2 + 50257 * 2048
    m = sim.memory({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    assert m.parameters == 2_327_721_472  # 2*Psi/8 + 2 * 1e9 live parameters
    assert m.gradients == 983_164_416  # (2 + 4) * Psi / 8
    assert m.optimizer_states == 1_966_328_832  # 12 * Psi / 8
    assert m.buffers == 1_000_000_000  # one fp16 reduce bucket of 5e8
    assert m.activations == 7_274_913_792  # 2 * (24 * 2048 * 61440 + 6 * 2048 * 50257)
    assert m.fragmentation == 661_993_103  # 8% of activations and buffers
    assert m.total == 15_556_298_895


def test_communication_volume_per_stage():
    sim = Simulator(GPT_1_3B, ONE_NODE)
    one = 7 / 8 * 2 * GPT_1_3B.num_params  # one ring reduce-scatter or all-gather of fp16 values
    volumes = [sim.communication_bytes({"zero_optimization": {"stage": s}}) for s in range(4)]
    assert volumes == [2 * one, 2 * one, 2 * one, 3 * one] == [4_588_100_608, 4_588_100_608, 4_588_100_608,
                                                                6_882_150_912]
    # stage 2 reduce-scatters every micro-step; stages 0 and 1 only at the boundary
    assert sim.communication_bytes({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}) == 5 * one
    assert sim.communication_bytes({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}) == 2 * one


def test_stage0_step_time_terms():
    sim = Simulator(GPT_1_3B, ONE_NODE)
    step = sim.step({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}, noise=False)
    # all-reduce: 4,588,100,608 bytes / 230 GB/s + 3 buckets * 2 * 24 us; Adam: 32 B/param over 1.55 TB/s
    assert step.exposed_comm_boundary_s == pytest.approx(4_588_100_608 / 230e9 + 3 * 2 * 24e-6, rel=1e-12)
    assert step.optimizer_s == pytest.approx(1_310_885_888 * 32 / 1.55e12, rel=1e-12)
    assert step.exposed_comm_micro_s == 0.0 and step.pressure == 1.0
    assert GPT_125M.flops_per_sample == 1_981_818_077_184  # 6sL*12h^2 + 12Ls^2h + 6sVh


def test_noise_is_fresh_on_every_run_and_repeats_across_simulators():
    a = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    b = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "overlap_comm": True}}
    sim = Simulator(GPT_125M, ONE_NODE, seed=7, noise_level=0.05)
    first, second = sim.run(a), sim.run(b)  # overlap_comm defaults to True in stage 3: the same config, run twice
    assert first.step.noise != second.step.noise
    again = Simulator(GPT_125M, ONE_NODE, seed=7, noise_level=0.05).run(b)  # the first run of it, again
    assert again.step.noise == first.step.noise and again.streams == first.streams
    assert [r["step"] for r in first.streams[0]] == [1, 2, 3, 4, 5, 6] and sorted(first.streams) == [0, 1]
    assert first.streams[0][0]["step_s"] > 2 * first.streams[0][1]["step_s"]  # step 1 is warm-up
    assert sim.step(a).noise == 1.0  # the ground truth is noise-free


def test_backend_writes_deepspeed_files_and_classifies(tmp_path):
    cluster = Cluster(A100_40, num_nodes=2, interconnect=IB_8x200G)
    backend = SimulatedBackend(Simulator(GPT_2_7B, cluster, seed=1))
    res = Reservation((Node("a", tuple(range(8))), Node("b", tuple(range(8)))))
    ok = backend.run(Experiment("z3_mbs5", {"train_micro_batch_size_per_gpu": 5, "zero_optimization": {"stage": 3}},
                                num_nodes=2, num_slots=8), res, tmp_path / "ok")
    metrics = json.loads((tmp_path / "ok" / "metrics.json").read_text())
    assert metrics["latency"] == pytest.approx(5 * 16 / metrics["throughput"] * 1e6)  # microseconds per step
    # zerotune's metric is the probe's, from the streams the SIMULATED run wrote; DeepSpeed's is kept beside it
    measured = measure(read_streams(tmp_path / "ok"), Objective.named("throughput"))
    assert ok.status == Status.OK and ok.metric_source == "probe" and ok.metric == measured.value > 0
    assert ok.metric != metrics["throughput"] and ok.peak_memory_bytes == Simulator(GPT_2_7B, cluster).memory(
        {"train_micro_batch_size_per_gpu": 5, "zero_optimization": {"stage": 3}}).total
    oom = backend.run(Experiment("z3_mbs8", {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}},
                                 num_nodes=2, num_slots=8), res, tmp_path / "oom")
    assert oom.status == Status.OOM and "CUDA out of memory" in oom.error and oom.metric is None
    assert not (tmp_path / "oom" / "metrics.json").exists()
    prof = backend.run(Experiment("profile", {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                                  num_nodes=2, num_slots=8, space="profile", kind=ExperimentKind.PROFILE), res,
                      tmp_path / "profile")
    info = json.loads((tmp_path / "profile" / "model_info.json").read_text())
    assert prof.status == Status.OK and info["num_params"] == GPT_2_7B.num_params == 2_645_240_320
    assert [(e.name, e.status, e.num_gpus) for e in backend.ledger] == [
        ("z3_mbs5", "ok", 16), ("z3_mbs8", "oom", 16), ("profile", "ok", 16)]


def test_deepspeed_autotuner_runs_on_the_simulator(tmp_path):
    from deepspeed.accelerator import get_accelerator

    from benchmarks.simcluster.deepspeed_harness import run_deepspeed_autotuner
    from benchmarks.simulated_cluster import USER_CONFIG

    cluster = Cluster(A100_40, num_nodes=2, interconnect=IB_8x200G)
    sim = Simulator(GPT_2_7B, cluster, seed=1016)
    chosen, reported, ledger = run_deepspeed_autotuner(sim, USER_CONFIG, tmp_path, ["a", "b"], 8)
    # DeepSpeed's own search trace (its fp16 estimate 20*Psi rules stage 0 out on 40 GB)
    assert [(e.name, e.status) for e in ledger] == [
        ("profile_model_info", "ok"), ("z1_gas1_tmbspg1", "ok"), ("z1_gas1_tmbspg6", "oom"),
        ("z1_gas1_tmbspg5", "oom"), ("z1_gas1_tmbspg4", "ok"), ("z1_gas2_tmbspg2", "ok"), ("z1_gas1_tmbspg3", "ok"),
        ("z2_gas1_tmbspg4", "ok"), ("z2_gas1_tmbspg7", "oom"), ("z2_gas1_tmbspg6", "oom"), ("z2_gas1_tmbspg5", "ok"),
        ("z3_gas1_tmbspg4", "ok"), ("z3_gas1_tmbspg8", "oom"), ("z3_gas1_tmbspg7", "oom"), ("z3_gas1_tmbspg6", "oom"),
        ("z3_gas1_tmbspg5", "ok")]
    assert (chosen["zero_optimization"], chosen["train_micro_batch_size_per_gpu"]) == ({"stage": 3}, 5)
    # DeepSpeed reports one run's noisy figure (1% noise): 60.28 samples/s against 60.07 noise-free
    assert reported == pytest.approx(60.27661789514326) and sim.step(chosen).throughput == pytest.approx(60.06810917803698)
    assert "total_memory" not in vars(get_accelerator())  # the memory patch is undone


def test_autotp_shards_the_model_states_over_its_degree_and_bf16_states_halve_the_optimizers():
    # Psi = 7.5B on N = 64: AutoTP 4 puts 1.875B on a rank, partitioned over 16 DP ranks at ZeRO-1
    psi, n = 7_500_000_000, 64
    tp4 = ZeroSettings.from_config({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 4}})
    assert model_state_bytes(tp4, psi, n) == (3.75e9, 3.75e9 + 4 * 1.875e9 / 16, 12 * 1.875e9 / 16)
    states = ZeroSettings.from_config({"zero_optimization": {"stage": 2},
                                       "bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    assert model_state_bytes(states, psi, n) == (15e9, 2 * psi / n + 2 * psi / n, 6 * psi / n)
    # ZeRO-3 takes no AutoTP (zerotune refuses the pair), stage 0 no bf16 states (DeepSpeed refuses them)
    assert ZeroSettings.from_config({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}).tp == 1


def test_an_autotp_step_counts_its_batch_once_and_its_probe_says_so():
    sim = Simulator(GPT_1_3B, ONE_NODE)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
           "tensor_parallel": {"autotp_size": 2}}
    step = sim.step(cfg)
    assert (step.samples, step.tp) == (4 * 8 // 2, 2)
    assert step.exposed_comm_micro_s >= sim.tp_all_reduce_s(4, 2) > 0
    outcome = sim.run(cfg)
    records = outcome.streams[0]
    assert {(r["train_batch_size"], r["autotp_size"]) for r in records} == {(32, 2)}
    assert sim.metrics(outcome)["throughput"] == pytest.approx(2 * step.samples / sim.metrics(outcome)["latency"] * 1e6)


def test_zerotune_reaches_the_simulated_optimum_of_autotp_2_with_bf16_states(tmp_path):
    from benchmarks.simulated_dimensions import SCENARIOS, run_scenario
    row = run_scenario(*SCENARIOS[0], str(tmp_path))  # GPT-13B on 4 nodes of 8 A100-40GB, one 100G NIC each
    assert (row["zerotune"], row["optimum"]) == ("z2/mbs12/gas2/tp2/bf16 states", "z2/mbs12/gas2/tp2/bf16 states")
    assert row["fraction"] == 1.0 and (row["launches"], row["ideal_launches"]) == (24, 2)


def test_a_ulysses_step_divides_a_ranks_activations_and_flops_by_its_degree_and_counts_its_batch_once():
    sim = Simulator(GPT_1_3B, ONE_NODE)
    plain = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    ulysses = {**plain, "sequence_parallel_size": 4}
    assert sim.memory(ulysses).activations == sim.memory(plain).activations // 4
    step = sim.step(ulysses)
    assert (step.samples, step.tp) == (4 * 8 // 4, 1)  # 2 replicas of 4 ranks; DeepSpeed's train_batch_size too
    assert step.exposed_comm_micro_s >= sim.ulysses_all_to_all_s(4, 4) > 0
    # a rank's quarter of 4 sequences: the FLOPs and tokens of one whole sequence
    assert sim.compute_s(4, sp=4) == pytest.approx(sim.compute_s(1))
    assert {r["train_batch_size"] for r in sim.run(ulysses).streams[0]} == {8}


def test_zerotune_reaches_the_simulated_optimum_of_ulysses_8_at_32k_tokens(tmp_path):
    from benchmarks.simulated_dimensions import SP_SCENARIOS, run_scenario
    row = run_scenario(*SP_SCENARIOS[0], str(tmp_path), space="ulysses")  # Llama-8B at 32k tokens, 8 A100-40GB
    assert (row["zerotune"], row["optimum"]) == ("z3/mbs3/sp8", "z3/mbs3/sp8")
    assert row["fraction"] == 1.0 and (row["launches"], row["ideal_launches"]) == (5, 2)


def test_a_partial_offload_keeps_whole_sub_groups_on_the_device_and_steps_them_there():
    sim = Simulator(LLAMA_70B, Cluster(A100_40, 4, ROCE_4x100G))  # 2.16B parameters a rank: 3 sub-groups of 1e9
    full = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    half = {**full, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    assert ZeroSettings.from_config(half).device_share(LLAMA_70B.num_params, 32) == 1 / 3  # int(0.5 * 3) = 1 kept
    assert sim.memory(half).optimizer_states == pytest.approx(12 * LLAMA_70B.num_params / 32 / 3, rel=1e-9)
    assert sim.memory(full).optimizer_states == 0
    assert sim.step(half).optimizer_s < sim.step(full).optimizer_s


def test_zerotune_reaches_the_simulated_optimum_of_a_partial_optimizer_offload(tmp_path):
    from benchmarks.simulated_dimensions import RATIO_SCENARIOS, run_scenario
    row = run_scenario(*RATIO_SCENARIOS[0], str(tmp_path), space="ratio")  # Llama-70B, 32 A100-40GB, mbs <= 4
    assert (row["zerotune"], row["optimum"]) == ("z3/mbs4/gas2/offload ratio 0.5", "z3/mbs4/gas2/offload ratio 0.5")
    assert row["fraction"] == 1.0 and (row["launches"], row["ideal_launches"]) == (5, 2)


def test_hpz_adds_a_secondary_partition_and_gathers_the_backward_inside_a_node():
    eth = Cluster(A100_40, 4, ETH_100G)
    sim = Simulator(GPT_1_3B, eth)
    plain = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    hpz = {**plain, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}
    psi = GPT_1_3B.num_params
    assert sim.memory(hpz).parameters - sim.memory(plain).parameters == 2 * psi // 8
    assert sim.step(hpz).exposed_comm_micro_s < sim.step(plain).exposed_comm_micro_s  # no inter-node backward gather
    quantized = {**plain, "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                 "zero_quantized_gradients": True}}
    assert sim.step(quantized).exposed_comm_micro_s < sim.step(plain).exposed_comm_micro_s
    assert ZeroSettings.from_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}).hpz == 1


def test_zerotune_reaches_the_simulated_optimum_of_hpz_over_a_node(tmp_path):
    from benchmarks.simulated_dimensions import HPZ_SCENARIOS, run_scenario
    row = run_scenario(*HPZ_SCENARIOS[0], str(tmp_path), space="hpz")  # Llama-70B, 4 nodes of 8 A100-80GB, 100G
    assert (row["zerotune"], row["optimum"]) == ("z3/mbs4/hpz8", "z3/mbs4/hpz8")
    assert row["fraction"] == 1.0 and (row["launches"], row["ideal_launches"]) == (4, 2)
