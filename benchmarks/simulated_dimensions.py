"""SIMULATED: zerotune's AutoTP and Ulysses degrees and bf16 states against the exhaustive optimum (issue 54).

Nothing here runs on a GPU. Each scenario is a model on a SIMULATED cluster (``benchmarks/simcluster/model.py``,
extended with AutoTP's sharding, activations and per-layer all-reduces and bf16 master weights and states). The user's
config lists ``tensor_parallel.autotp_size`` [1, 2, 4], sets ``bf16`` with ``autotuning.allow_reduced_precision_states``
and ZeRO stages [0, 1, 2] (zerotune tunes AutoTP at stages 0-2, D331). The optimum is exhaustive over that space
(stage x degree x bf16 states x mbs 1..1024, gas 1; zerotune's pick where it is better, at gas > 1). Per
scenario: zerotune's pick as a fraction of the optimum's noise-free samples/s, its launches, and the ideal's: the
profile plus one run per variant (stage, degree, states) whose best is within the noise level of the optimum (as
``benchmarks/simulated_cluster.py``'s ideal, D28). The Ulysses scenarios' config lists ``sequence_parallel_size``
[1, 2, 4, 8] at ZeRO stages [1, 2, 3] instead, over stage x degree x mbs. The offload ratio scenario tunes ZeRO-3 at
mbs up to 4 (a global batch the user bounds), its config offloading the optimizer (no profile fits without), over no
offload and each share of the optimizer's sub-groups kept on the
device (``offload_optimizer.ratio``) x mbs. The hpZ scenario tunes ZeRO-3 on several nodes at mbs up to 4, over
``zero_hpz_partition_size`` 1 and the GPUs per node x mbs (fast mode: the quantized collectives, knobs, are not run).

Run from the repository root: ``.venv/bin/python -m benchmarks.simulated_dimensions`` (seconds).
"""
from __future__ import annotations

import io
import itertools
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from rich.console import Console  # noqa: E402

from benchmarks.simcluster import scenarios as sc  # noqa: E402
from benchmarks.simcluster.backend import SimulatedBackend  # noqa: E402
from benchmarks.simcluster.model import Cluster, Simulator, ZeroSettings  # noqa: E402
from zerotune.autotuner import Autotuner, TuneOptions  # noqa: E402
from zerotune.run.resources import select_resources  # noqa: E402
from zerotune.strategy.partial_offload import offload_ratio  # noqa: E402

MAX_MBS = 1024
DEGREES = [1, 2, 4]
SCENARIOS = [("GPT-13B 32xA100-40GB Eth 1x100G", sc.GPT_13B, Cluster(sc.A100_40, 4, sc.ETH_100G), 2001),
             ("GPT-13B 32xA100-40GB RoCE 4x100G", sc.GPT_13B, Cluster(sc.A100_40, 4, sc.ROCE_4x100G), 2005),
             ("GPT-13B 8xA100-80GB one node", sc.GPT_13B, Cluster(sc.A100_80, 1, sc.NONE), 2002),
             ("GPT-6.7B 8xA100-40GB one node", sc.GPT_6_7B, Cluster(sc.A100_40, 1, sc.NONE), 2003),
             ("GPT-2.7B 8xA100-40GB one node", sc.GPT_2_7B, Cluster(sc.A100_40, 1, sc.NONE), 2004)]
USER_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": [0, 1, 2]},
    "tensor_parallel": {"autotp_size": DEGREES},
    "autotuning": {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 3,
                   "end_profile_step": 5, "max_train_micro_batch_size_per_gpu": MAX_MBS,
                   "allow_reduced_precision_states": True}}


def variant_config(stage: int, tp: int, states: bool, mbs: int) -> dict[str, Any]:
    """The space's config: stage, AutoTP degree, bf16 states or not, mbs, gas 1."""
    bf16 = {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                if states else {})}
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": bf16,
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}}


def bests_over(sim: Simulator, variants, config_of, max_mbs: int = MAX_MBS) -> dict[tuple, tuple[int, float]]:
    """Variant -> (its best mbs, noise-free samples/s) for each of ``variants`` (argument tuples of ``config_of``, whose
    last argument is the mbs) where some mbs up to ``max_mbs`` fits; a variant's search stops at its first mbs that
    does not."""
    out = {}
    for variant in variants:
        for mbs in range(1, max_mbs + 1):
            value = sim.throughput(config_of(*variant, mbs))
            if value is None:
                break
            if value > out.get(variant, (0, 0.0))[1]:
                out[variant] = (mbs, value)
    return out


def variant_bests(sim: Simulator) -> dict[tuple, tuple[int, float]]:
    """(stage, degree, states) -> (its best mbs, noise-free samples/s): bf16 states at ZeRO 1-3 only (DeepSpeed)."""
    variants = [(stage, tp, states) for stage, tp, states in itertools.product((0, 1, 2), DEGREES, (False, True))
                if not (states and stage == 0)]
    return bests_over(sim, variants, variant_config)


SP_DEGREES = [1, 2, 4, 8]
SP_SCENARIOS = [("Llama-8B 32k tokens 8xA100-40GB", sc.LLAMA_8B_32K, Cluster(sc.A100_40, 1, sc.NONE), 2011),
                ("Llama-8B 32k tokens 8xH100-80GB", sc.LLAMA_8B_32K, Cluster(sc.H100_80, 1, sc.NONE), 2012)]
SP_CONFIG: dict[str, Any] = {**{k: v for k, v in USER_CONFIG.items() if k != "tensor_parallel"},
                             "zero_optimization": {"stage": [1, 2, 3]}, "sequence_parallel_size": SP_DEGREES,
                             "autotuning": {**USER_CONFIG["autotuning"], "allow_reduced_precision_states": False}}


def sp_config(stage: int, sp: int, mbs: int) -> dict[str, Any]:
    """The Ulysses space's config: stage, degree, mbs, gas 1."""
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp}


def sp_bests(sim: Simulator) -> dict[tuple, tuple[int, float]]:
    """(stage, Ulysses degree) -> (its best mbs, noise-free samples/s)."""
    return bests_over(sim, list(itertools.product((1, 2, 3), SP_DEGREES)), sp_config)


RATIO_MAX_MBS = 4
RATIO_SCENARIOS = [("Llama-70B 32xA100-40GB RoCE mbs<=4", sc.LLAMA_70B, Cluster(sc.A100_40, 4, sc.ROCE_4x100G), 2021)]
RATIO_CONFIG: dict[str, Any] = {**{k: v for k, v in SP_CONFIG.items() if k != "sequence_parallel_size"},
                                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                "autotuning": {**SP_CONFIG["autotuning"],
                                               "max_train_micro_batch_size_per_gpu": RATIO_MAX_MBS}}


def ratio_config(kept: int | None, groups: int, mbs: int) -> dict[str, Any]:
    """The ratio space's config: ZeRO-3 at ``mbs``, gas 1, with no offload (``kept`` None) or the optimizer offloaded
    but ``kept`` of its ``groups`` sub-groups a rank (0: a full offload, no ratio written)."""
    zero: dict[str, Any] = {"stage": 3}
    if kept is not None:
        zero["offload_optimizer"] = {"device": "cpu", **({"ratio": offload_ratio(kept, groups)} if kept else {})}
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero}


def ratio_bests(sim: Simulator) -> dict[tuple, tuple[int, float]]:
    """(sub-groups kept or None, G) -> (its best mbs up to 4, noise-free samples/s)."""
    groups = max(1, math.ceil(sim.model.num_params / sim.cluster.num_gpus / 1e9))
    return bests_over(sim, [(kept, groups) for kept in (None, *range(groups))], ratio_config, RATIO_MAX_MBS)


HPZ_SCENARIOS = [("Llama-70B 32xA100-80GB Eth mbs<=4", sc.LLAMA_70B, Cluster(sc.A100_80, 4, sc.ETH_100G), 2031)]
HPZ_CONFIG: dict[str, Any] = {**RATIO_CONFIG, "zero_optimization": {"stage": 3}}


def hpz_config(hpz: int, mbs: int) -> dict[str, Any]:
    """The hpZ space's config: ZeRO-3 at ``mbs``, gas 1, with a secondary partition over ``hpz`` ranks (1: none)."""
    zero: dict[str, Any] = {"stage": 3, **({"zero_hpz_partition_size": hpz} if hpz > 1 else {})}
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero}


def hpz_bests(sim: Simulator) -> dict[tuple, tuple[int, float]]:
    """(hpZ degree,) -> (its best mbs up to 4, noise-free samples/s)."""
    return bests_over(sim, [(1,), (sim.cluster.gpus_per_node,)], hpz_config, RATIO_MAX_MBS)


def describe(cfg: dict[str, Any] | None) -> str:
    if cfg is None:
        return "-"
    z = ZeroSettings.from_config(cfg)
    return (f"z{z.stage}/mbs{z.mbs}" + (f"/gas{z.gas}" if z.gas > 1 else "") + (f"/tp{z.tp}" if z.tp > 1 else "")
            + (f"/sp{z.sp}" if z.sp > 1 else "") + ("/bf16 states" if z.bf16_states else "")
            + (f"/offload{'' if z.offload_ratio == 1 else f' ratio {z.offload_ratio:g}'}" if z.offload_optimizer
               else "") + (f"/hpz{z.hpz}" if z.hpz > 1 else ""))


def run_zerotune(sim: Simulator, workdir: Path, user_config: dict[str, Any] = USER_CONFIG
                 ) -> tuple[dict[str, Any] | None, int]:
    """zerotune's answer on ``sim`` for ``user_config`` and its launches (the profile included)."""
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"sim-node-{i} slots={sim.cluster.gpus_per_node}\n"
                                for i in range(sim.cluster.num_nodes)))
    config = workdir / "ds.json"
    config.write_text(json.dumps(user_config))
    backend = SimulatedBackend(sim, metric="throughput", start_profile_step=3, end_profile_step=5)
    options = TuneOptions(device_memory_bytes=sim.cluster.device.memory_bytes, results_dir=str(workdir / "r"),
                          overwrite=True, cpu=False, hostfile=str(hostfile))
    tuner = Autotuner("simulated_train.py", ["--deepspeed_config", str(config)], select_resources(hostfile), options,
                      console=Console(file=io.StringIO()), backend=backend)
    backend.stop_rule = tuner.job.stop_rule
    return tuner.tune().ds_config, len(backend.ledger)


SPACES = {"autotp": (variant_bests, variant_config, USER_CONFIG), "ulysses": (sp_bests, sp_config, SP_CONFIG),
          "ratio": (ratio_bests, ratio_config, RATIO_CONFIG), "hpz": (hpz_bests, hpz_config, HPZ_CONFIG)}


def run_scenario(name: str, model, cluster: Cluster, seed: int, tmp: str, space: str = "autotp") -> dict[str, Any]:
    sim = Simulator(model, cluster, seed=seed)
    bests_of, config_of, user_config = SPACES[space]
    bests = bests_of(sim)
    variant, (mbs, optimum) = max(bests.items(), key=lambda kv: kv[1][1])
    within = [v for v, (_, value) in bests.items() if value >= (1 - sim.noise_level) * optimum]
    with tempfile.TemporaryDirectory(dir=tmp) as workdir:
        chosen, launches = run_zerotune(sim, Path(workdir), user_config)
    true = sim.throughput(chosen) if chosen else None
    best_cfg = config_of(*variant, mbs)
    if true is not None and true > optimum:  # zerotune's pick is outside the space (gas > 1) and better
        best_cfg, optimum = chosen, true
    return {"scenario": name, "optimum": describe(best_cfg), "optimum_samples_s": optimum,
            "zerotune": describe(chosen), "fraction": (true or 0.0) / optimum, "launches": launches,
            "ideal_launches": 1 + len(within)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_scenario(*sc, tmp) for sc in SCENARIOS]
        sp_rows = [run_scenario(*sc, tmp, space="ulysses") for sc in SP_SCENARIOS]
        ratio_rows = [run_scenario(*sc, tmp, space="ratio") for sc in RATIO_SCENARIOS]
        hpz_rows = [run_scenario(*sc, tmp, space="hpz") for sc in HPZ_SCENARIOS]
    print("SIMULATED (benchmarks/simcluster: no GPU ran): zerotune with autotp_size [1, 2, 4] and bf16 states allowed")
    report(rows)
    print("SIMULATED: zerotune with sequence_parallel_size [1, 2, 4, 8] at ZeRO stages [1, 2, 3]")
    report(sp_rows)
    print("SIMULATED: zerotune on ZeRO-3 at mbs <= 4, where only an offloaded optimizer fits")
    report(ratio_rows)
    print("SIMULATED: zerotune on ZeRO-3 over 4 nodes at mbs <= 4, hpZ probed on the best")
    report(hpz_rows)


def report(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"{r['scenario']:32} optimum {r['optimum']:28} {r['optimum_samples_s']:8.2f} samples/s | zerotune "
              f"{r['zerotune']:28} {r['fraction']:7.2%} of it, {r['launches']} launches (ideal {r['ideal_launches']})")


if __name__ == "__main__":
    main()
