"""SIMULATED scenarios: models from 125M to 70B parameters on 8 to 1024 GPUs.

Devices and networks carry round figures close to public data sheets (achievable, not peak,
bandwidths); they describe no particular machine. Model shapes are GPT-3's (Brown et al. 2020,
table 2.1), OPT-30B's and a Llama-2-70B-like shape (grouped-query attention, SwiGLU).
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.simcluster.model import Cluster, Device, GiB, Interconnect, Transformer

A100_40 = Device("A100-40GB", peak_flops=312e12, memory_bytes=40 * GiB, hbm_bytes_per_s=1.55e12,
                 nvlink_bytes_per_s=230e9, mfu_max=0.62)
A100_80 = Device("A100-80GB", peak_flops=312e12, memory_bytes=80 * GiB, hbm_bytes_per_s=2.0e12,
                 nvlink_bytes_per_s=230e9, mfu_max=0.62)
H100_80 = Device("H100-80GB", peak_flops=989e12, memory_bytes=80 * GiB, hbm_bytes_per_s=3.35e12,
                 nvlink_bytes_per_s=360e9, mfu_max=0.52)
A100_40_PCIE = Device("A100-40GB-PCIe", peak_flops=312e12, memory_bytes=40 * GiB, hbm_bytes_per_s=1.55e12,
                      nvlink_bytes_per_s=20e9, mfu_max=0.62)

ETH_100G = Interconnect("Eth 1x100G", bytes_per_s=11e9, latency_s=30e-6)
ROCE_4x100G = Interconnect("RoCE 4x100G", bytes_per_s=45e9, latency_s=12e-6)
IB_8x200G = Interconnect("IB 8x200G", bytes_per_s=180e9, latency_s=5e-6)
IB_8x400G = Interconnect("IB 8x400G", bytes_per_s=360e9, latency_s=4e-6)
NONE = Interconnect("single node", bytes_per_s=0.0, latency_s=0.0)

GPT_125M = Transformer("GPT-125M", 12, 768, 3072, 50257)
GPT_350M = Transformer("GPT-350M", 24, 1024, 4096, 50257)
GPT_760M = Transformer("GPT-760M", 24, 1536, 6144, 50257)
GPT_1_3B = Transformer("GPT-1.3B", 24, 2048, 8192, 50257)
GPT_2_7B = Transformer("GPT-2.7B", 32, 2560, 10240, 50257)
GPT_6_7B = Transformer("GPT-6.7B", 32, 4096, 16384, 50257, activation_checkpointing=True)
GPT_13B = Transformer("GPT-13B", 40, 5120, 20480, 50257, activation_checkpointing=True)
OPT_30B = Transformer("OPT-30B", 48, 7168, 28672, 50272, activation_checkpointing=True)
LLAMA_70B = Transformer("Llama-70B", 80, 8192, 28672, 32000, kv_fraction=0.125, gated_mlp=True,
                        tied_embeddings=False, activation_checkpointing=True)
LLAMA_8B_32K = Transformer("Llama-8B-32k", 32, 4096, 14336, 128256, seq_len=32768, kv_fraction=0.25, gated_mlp=True,
                           tied_embeddings=False, activation_checkpointing=True)


@dataclass(frozen=True)
class Scenario:
    """One SIMULATED workload: a model trained on a cluster; ``seed`` seeds its noise."""

    name: str
    model: Transformer
    cluster: Cluster
    seed: int


def _scenarios() -> list[Scenario]:
    rows = [
        # model, device, nodes, interconnect
        (GPT_125M, A100_40, 1, NONE),
        (GPT_125M, A100_40_PCIE, 1, NONE),
        (GPT_125M, H100_80, 4, ETH_100G),
        (GPT_125M, A100_80, 16, IB_8x200G),
        (GPT_350M, A100_40, 1, NONE),
        (GPT_350M, A100_80, 2, ETH_100G),
        (GPT_350M, H100_80, 8, ROCE_4x100G),
        (GPT_350M, A100_40, 32, IB_8x200G),
        (GPT_760M, A100_40, 2, ROCE_4x100G),
        (GPT_760M, H100_80, 1, NONE),
        (GPT_760M, A100_80, 8, ETH_100G),
        (GPT_1_3B, A100_40, 1, NONE),
        (GPT_1_3B, A100_40_PCIE, 1, NONE),
        (GPT_1_3B, A100_80, 4, IB_8x200G),
        (GPT_1_3B, H100_80, 16, ETH_100G),
        (GPT_1_3B, A100_40, 64, IB_8x200G),
        (GPT_2_7B, A100_40, 2, IB_8x200G),
        (GPT_2_7B, A100_80, 1, NONE),
        (GPT_2_7B, H100_80, 8, ROCE_4x100G),
        (GPT_2_7B, A100_40, 16, ETH_100G),
        (GPT_6_7B, A100_40, 4, IB_8x200G),
        (GPT_6_7B, A100_80, 2, ROCE_4x100G),
        (GPT_6_7B, H100_80, 16, IB_8x400G),
        (GPT_6_7B, A100_80, 32, ETH_100G),
        (GPT_13B, A100_80, 4, IB_8x200G),
        (GPT_13B, A100_40, 8, ROCE_4x100G),
        (GPT_13B, H100_80, 32, IB_8x400G),
        (GPT_13B, A100_80, 64, ETH_100G),
        (OPT_30B, A100_80, 8, IB_8x200G),
        (OPT_30B, H100_80, 16, IB_8x400G),
        (OPT_30B, A100_40, 32, ROCE_4x100G),
        (OPT_30B, H100_80, 128, IB_8x400G),
        (LLAMA_70B, A100_80, 16, IB_8x200G),
        (LLAMA_70B, H100_80, 32, IB_8x400G),
        (LLAMA_70B, A100_40, 64, IB_8x200G),
        (LLAMA_70B, H100_80, 128, IB_8x400G),
    ]
    out = []
    for i, (model, device, nodes, net) in enumerate(rows):
        cluster = Cluster(device=device, num_nodes=nodes, interconnect=net)
        name = f"{model.name} {cluster.num_gpus}x{device.name} {net.name}"
        out.append(Scenario(name, model, cluster, seed=1000 + i))
    return out


SCENARIOS: list[Scenario] = _scenarios()
