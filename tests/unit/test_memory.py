"""The memory model pinned to exact byte counts (formulas and DeepSpeed sources in zerotune/model/memory.py)."""
import pytest

from zerotune.model.memory import MemoryModel

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
FP16 = {"fp16": {"enabled": True}}


def cfg(stage, **zero):
    return {**ADAMW, "zero_optimization": {"stage": stage, **zero}}


MODEL = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4)


def test_stage0_fp32_adam_no_master_copy():
    b = MODEL.breakdown(cfg(0), mbs=2)
    # params 4*Psi, grads 4*Psi, Adam states 8*Psi (no fp32 master copy in fp32 stage 0),
    # all-reduce flatten buffer 4*min(Psi, 5e8), activations 1000*2.
    assert (b.parameters, b.gradients, b.optimizer_states, b.buffers, b.activations) == \
        (4_000_000, 4_000_000, 8_000_000, 4_000_000, 2_000)
    # stage 0 reduces after the backward pass, when the activations are freed: the peak holds the
    # larger of the activations and the flat copy, here the copy (apart = min(2,000, 4,000,000))
    assert b.apart == 2_000 and b.total == 20_000_000


def test_stage1_fp16_partitions_optimizer_states_only():
    b = MODEL.breakdown({**cfg(1), **FP16}, mbs=1)
    # K = 12 (master + 2 Adam states) over N=4; full fp16 grads + fp32 grad partition; one 5e8 bucket
    # and the reduction's flat copy of the bucket's content, 2*min(5e8, Psi) (stage_1_and_2.py:2367).
    assert (b.parameters, b.gradients, b.optimizer_states, b.buffers) == (2_000_000, 3_000_000, 3_000_000,
                                                                         1_002_000_000)
    assert b.apart == 1_000 and b.total == 1_010_000_000  # no overlap_comm: reduced after the backward


def test_stage2_overlap_comm_doubles_the_bucket():
    b = MODEL.breakdown({**cfg(2, overlap_comm=True, reduce_bucket_size=5e7), **FP16}, mbs=1)
    # two 5e7-element buckets and the flat copy 2*min(5e7, Psi)
    assert (b.parameters, b.gradients, b.optimizer_states, b.buffers) == (2_000_000, 1_500_000, 3_000_000, 202_000_000)
    assert b.apart == 1_000 and b.total == 208_500_000  # the bucket holds all of T: reduced after the backward


def test_stage3_fp16_and_offload():
    # buffers: the 5e8 bucket, the reduce-scatter's copy 2*min(5e8, Psi) and the all-gather's flat
    # buffer 2*min(G, 5e7) with G = Psi (coalesced_collectives.py:122, partition_parameters.py:1343)
    assert MODEL.bytes_per_device({**cfg(3), **FP16}, mbs=1) == \
        2_500_000 + 1_500_000 + 3_000_000 + 1_000_000_000 + 2_000_000 + 2_000_000  # activations apart
    offload = cfg(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    b = MODEL.breakdown({**offload, **FP16}, mbs=1)
    # gathered params stay on the device; the gradient partition buffer follows the optimizer to the host
    assert (b.parameters, b.gradients, b.optimizer_states) == (2_000_000, 0, 0)
    # host per rank: param partition 2*Psi/4 + grad partition 2*Psi/4 + fp32 grad 4*Psi/4 + (8 + 4)*Psi/4
    assert b.host == 500_000 + 500_000 + 1_000_000 + 3_000_000


def test_zero3_default_bucket_is_two_gigabytes_in_fp32():
    # plus the reduce-scatter copy and the all-gather buffer, 4*Psi each
    assert MODEL.breakdown(cfg(3)).buffers == 2_000_000_000 + 4_000_000 + 4_000_000


def test_mp_size_applied_once():
    # DeepSpeed's num_params is the total over MP ranks: 2e6 params with mp_size 2 is 1e6 per device.
    mp = MemoryModel(num_params=2_000_000, activation_bytes_per_sample=1_000, dp_world_size=4, mp_size=2)
    for stage in range(4):
        assert mp.bytes_per_device(cfg(stage), 3) == MODEL.bytes_per_device(cfg(stage), 3)


def test_max_mbs_and_fits():
    model = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000_000, dp_world_size=4)
    budget = 30_000_000  # stage 0 fixed part is 20,000,000 bytes; 1,000,000 bytes per sample
    # the first 4,000,000 bytes of activations share their room with the flat copy made after the backward
    assert model.max_mbs(cfg(0), budget) == 14
    assert model.fits(cfg(0), budget, mbs=14) and not model.fits(cfg(0), budget, mbs=15)
    assert model.max_mbs(cfg(0), budget, cap=4) == 4
    assert model.max_mbs(cfg(1), budget) == 0  # the 2 GB bucket alone is over budget
    assert MODEL.max_mbs(cfg(0), 20_000_000) == 1024  # 1,000 bytes a sample: 4,000 samples under the copy


def test_calibration_sets_overhead_from_a_measured_peak():
    measured = MODEL.bytes_per_device(cfg(3), 1) + 400_000_000
    cal = MODEL.calibrated(cfg(3), measured, mbs=1)
    assert cal.overhead_bytes == 400_000_000
    assert cal.bytes_per_device(cfg(3), 1) == measured
    assert MODEL.calibrated(cfg(3), 0).overhead_bytes == 0


@pytest.mark.parametrize("opt,expected", [("SGD", 4 + 4), ("Adagrad", 4 + 4), ("Lamb", 8 + 4)])
def test_optimizer_state_bytes(opt, expected):
    c = {"optimizer": {"type": opt}, "zero_optimization": {"stage": 1}}
    assert MODEL.breakdown(c).optimizer_states == expected * 1_000_000 // 4


def test_offload_moves_the_optimizer_and_the_parameters_to_the_host():
    # fp16, Psi = T = 1,000,000, N = 4, Adam (K = 8), mbs 1; host bytes are per rank
    b = MODEL.breakdown({**cfg(2, offload_optimizer={"device": "cpu"}), **FP16}, mbs=1)
    # stage 2, optimizer on the host: the device keeps the fp16 parameters 2*Psi = 2,000,000 and no gradient
    # partition (accumulated into the host's); buffers: one 5e8-element bucket 2*5e8 = 1,000,000,000 plus the
    # reduction's flat copy 2*min(5e8, T) = 2,000,000. Host: fp32 gradient 4*T/N = 1,000,000, Adam 8*T/N =
    # 2,000,000, fp32 master 4*T/N = 1,000,000
    assert (b.parameters, b.gradients, b.optimizer_states, b.buffers, b.host) == \
        (2_000_000, 0, 0, 1_002_000_000, 4_000_000)
    # the bucket holds all of T: reduced after the backward, the 1,000 bytes of activations apart
    assert (b.activations, b.apart, b.total) == (1_000, 1_000, 1_004_000_000)
    both = {**cfg(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}), **FP16}
    b = MODEL.breakdown(both, mbs=1)
    # stage 3, both on the host: the device holds the gathered parameters 2*G = 2*Psi = 2,000,000 (G = Psi under
    # DeepSpeed's 1e9 limits); buffers: the bucket 1,000,000,000, the reduce-scatter's copy 2*min(5e8, T) =
    # 2,000,000 and the all-gather buffer 2*min(G, 5e7) = 2,000,000. Host: parameter partition 2*Psi/N = 500,000,
    # gradient partition 2*T/N = 500,000, fp32 gradient 1,000,000, Adam 2,000,000, master 1,000,000
    assert (b.parameters, b.gradients, b.optimizer_states, b.buffers, b.host) == \
        (2_000_000, 0, 0, 1_004_000_000, 5_000_000)
    assert b.total == 1_006_000_000
    # on CPU ranks the host is the rank's own process: its 5,000,000 bytes count against the device budget
    on_cpu = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4, host_on_device=True)
    assert on_cpu.bytes_per_device(both, mbs=1) == 1_011_000_000


CHECKPOINTED = MemoryModel(num_params=1_000_000, activation_bytes_per_sample=1_000, dp_world_size=4,
                           checkpointed_activation_bytes_per_sample=300)


def test_a_config_with_checkpointing_uses_the_checkpointed_activation_term():
    # fp16 stage 2, overlap_comm, a 5e5-element bucket (less than T: reduced in the backward, nothing apart):
    # params 2*Psi = 2,000,000, grads 2*T/N + 4*T/N = 1,500,000, Adam and master 12*T/N = 3,000,000, two buckets
    # 2*2*5e5 = 2,000,000 and the flat copy 2*5e5 = 1,000,000: 9,500,000 fixed
    z2 = {**cfg(2, overlap_comm=True, reduce_bucket_size=500_000), **FP16}
    on = {**z2, "gradient_checkpointing": True}
    assert CHECKPOINTED.breakdown(on, mbs=4).activations == 4 * 300
    assert CHECKPOINTED.bytes_per_device(on, mbs=4) == 9_500_000 + 1_200
    assert CHECKPOINTED.bytes_per_device(z2, mbs=4) == 9_500_000 + 4 * 1_000  # absent: the plain term
    assert CHECKPOINTED.bytes_per_device({**z2, "gradient_checkpointing": False}, mbs=4) == 9_504_000
    # a term not priced: the plain one
    assert MODEL.breakdown({**on, **FP16}, mbs=4).activations == 4_000
    # 30,000 bytes over the fixed part: 100 samples of 300 bytes, 30 of 1,000
    assert (CHECKPOINTED.max_mbs(on, 9_530_000), CHECKPOINTED.max_mbs(z2, 9_530_000)) == (100, 30)
