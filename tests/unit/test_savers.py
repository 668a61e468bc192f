"""The savers phase (zerotune.strategy.savers) inside the whole Strategy, on known curves (no launch).

A scripted ``evaluate`` answers each experiment from a known memory model (out of memory above the budget) and a
known step time per (mbs, saver), so the exact launches and each saver's decision and reason are asserted.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from zerotune.core.experiment import ExperimentKind, Status
from zerotune.deepspeed.keys import CHECKPOINTING
from zerotune.inputs.job import Job, TuneOptions
from zerotune.run.resources import select_resources
from zerotune.strategy.savers import bf16_states_apply, savers_for
from zerotune.strategy.tuning import Strategy

GiB, MiB = 2**30, 2**20
PSI = 300_000_000  # fp32, Adam, 2 ranks, 8 GiB each: ZeRO-3 fits mbs 5, with the optimizer offloaded 17,
ACTIVATIONS = 256 * MiB  # with the parameters offloaded too 19 (MemoryModel, DeepSpeed's default buckets)


def make_job(tmp_path: Path, cpu: bool = False, max_mbs: int = 32, bf16: dict | None = None, extra: dict | None = None,
             **options) -> Job:
    """``bf16``: the config's ``bf16`` section and ``autotuning.allow_reduced_precision_states`` (its key
    ``"allow"``), else fp32; ``extra``: top-level sections over the config's."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "ds.json"
    bf16 = dict(bf16 or {})
    allow = {"allow_reduced_precision_states": bf16.pop("allow")} if "allow" in bf16 else {}
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                  "zero_optimization": {"stage": 3}, **({"bf16": bf16} if bf16 else {}),
                                  "autotuning": {"enabled": True, "fast": True, **allow,
                                                 "max_train_micro_batch_size_per_gpu": max_mbs}, **(extra or {})}))
    return Job.build(str(tmp_path / "train.py"), ["--deepspeed_config", str(config)], select_resources(local_slots=2),
                     TuneOptions(device_memory_bytes=8 * GiB, results_dir=str(tmp_path / "results"), cpu=cpu,
                                 **options))


def saver_of(ds_config: dict) -> str:
    zero = ds_config["zero_optimization"]
    name = "+".join(k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "cpu")
    name += f" ratio {zero['offload_optimizer']['ratio']}" if "ratio" in (zero.get("offload_optimizer") or {}) else ""
    name = name or "+".join(f"{k}:nvme" for k in ("offload_optimizer", "offload_param")
                            if (zero.get(k) or {}).get("device") == "nvme")
    name = ("ckpt" + ("+" if name else "") if ds_config.get(CHECKPOINTING) else "") + name
    tp = ds_config.get("tensor_parallel", {}).get("autotp_size", 1)
    name = f"tp{tp}" + ("+" if name else "") + name if tp > 1 else name
    sp = ds_config.get("sequence_parallel_size", 1)
    name = f"sp{sp}" + ("+" if name else "") + name if sp > 1 else name
    return "bf16 states" + ("+" if name else "") + name if ds_config.get("bf16", {}).get(
        "bf16_optimizer_states") else name


def tune(tmp_path: Path, step_s, cpu: bool = False, peaks: bool = False, max_mbs: int = 32,
         checkpointing: bool = False, bf16: dict | None = None, extra: dict | None = None, capacity: int = 8 * GiB,
         activations: int = ACTIVATIONS, **options) -> tuple[list[tuple[int, str, str]], Strategy]:
    """The Strategy where a run at ``mbs`` with saver ``s`` (:func:`saver_of`) takes ``step_s(mbs, s)`` seconds
    per step (samples/s = mbs * 2 ranks / Ulysses degree / step), known to +-1%, and runs out of memory where the
    model's
    estimate is over the budget, ``peaks``: peaking at that estimate (else of unknown peak); ``checkpointing``: the
    script takes activation checkpointing; ([(mbs, saver, status)] in launch order, the strategy)."""
    ran = []

    def evaluate(exps):
        for exp in exps:
            if exp.kind is ExperimentKind.PROFILE:
                exp.status = Status.OK
                exp.metrics = {"num_params": PSI, "trainable_num_params": PSI, "activation_mem_per_gpu": activations}
                continue
            saver = saver_of(exp.ds_config)
            predicted = strategy.result.memory.bytes_per_device(exp.ds_config)
            fits = predicted <= capacity  # the device's real capacity; the budget is 8 GiB
            exp.status = Status.OK if fits else Status.OOM
            exp.peak_memory_bytes = predicted if fits and peaks else None  # it peaks where the model says
            ran.append((exp.mbs, saver, exp.status.value))
            if fits:
                replicas = 2 // exp.ds_config.get("sequence_parallel_size", 1)
                exp.metric, exp.metric_rel_half_width = replicas * exp.mbs / step_s(exp.mbs, saver), 0.01
        return exps

    strategy = Strategy(replace(make_job(tmp_path, cpu, max_mbs, bf16, extra, **options), checkpointing=checkpointing),
                        evaluate)
    strategy.run()
    return ran, strategy


def decisions(strategy: Strategy) -> list[tuple[str, str, int]]:
    return [(r.label, r.decision.value, r.estimate) for r in strategy.result.stages]


def test_each_stage_has_its_savers_cheapest_first():
    assert [s.name for s in savers_for(0, False)] == []
    assert [s.name for s in savers_for(0, True)] == ["checkpointing"]
    assert [s.name for s in savers_for(2, False)] == ["offload optimizer"]
    assert [s.name for s in savers_for(3, True)] == [
        "checkpointing", "offload optimizer", "checkpointing + offload optimizer", "offload optimizer+params",
        "checkpointing + offload optimizer+params"]
    assert savers_for(3, True)[2].settings == {CHECKPOINTING: True,
                                               "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


OFFLOAD_PAYS = {"": 0.0, "offload_optimizer": 0.5, "offload_optimizer+offload_param": 1.0}
OFFLOAD_COSTS = {"": 0.0, "offload_optimizer": 3.0, "offload_optimizer+offload_param": 3.5}


def test_where_memory_binds_the_best_stage_offload_runs_its_larger_mbs_and_wins(tmp_path):
    # step = 1 s + 0.1 s per sample (+0.5 s with the optimizer offloaded, +1 s with the parameters too). ZeRO-3
    # fits mbs 5: 6.667 samples/s. Offloading the optimizer fits 17: 2*17/3.2 = 10.62, a win, so it is searched
    # and becomes the best; the parameters too fit 19: 9.744, a loss. The halvings below 5 and 17 are not launched:
    # the affine step time lets each gain 2.2% at most, within what one run resolves (±3.2%, D322).
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_PAYS[saver])
    assert ran[:3] == [(5, "", "ok"), (17, "offload_optimizer", "ok"), (19, "offload_optimizer+offload_param", "ok")]
    assert [p.name for p in strategy.result.predictions] == ["z3_gas1_tmbspg2", "z3_gas1_tmbspg8_oocpu"]
    # each launch records the rule that bought it (the summary's cost plan names those beyond the plan)
    assert [(e.name, e.bought_by) for e in strategy.result.experiments if e.status is Status.OK][1:4] == [
        ("z3_gas1_tmbspg5", "ZeRO stages and mbs: ZeRO stage 3: its mbs search"),
        ("z3_gas1_tmbspg17_oocpu", "memory savers: ZeRO stage 3 + offload optimizer: its probe"),
        ("z3_gas1_tmbspg19_oocpu_opcpu", "memory savers: ZeRO stage 3 + offload optimizer+params: its probe")]
    assert decisions(strategy) == [("ZeRO stage 3", "explored", 5), ("ZeRO stage 3 + offload optimizer", "explored", 17),
                                   ("ZeRO stage 3 + offload optimizer+params", "probed", 19)]
    assert [r.reason for r in strategy.result.stages[1:]] == [
        "memory model: largest mbs 17 (without it: 5); probe at mbs=17 beat the best (10.62 > 6.667, ZeRO stage 3)",
        "memory model: largest mbs 19 (without it: 5); probe at mbs=19: ok 9.744, not better than ZeRO stage 3 + "
        "offload optimizer's 10.62 at mbs=17"]
    assert strategy.result.answer.name == "z3_gas1_tmbspg17_oocpu"


def test_offload_that_costs_more_than_its_larger_mbs_gains_is_probed_and_lost(tmp_path):
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_COSTS[saver])
    assert ran[:3] == [(5, "", "ok"), (17, "offload_optimizer", "ok"), (19, "offload_optimizer+offload_param", "ok")]
    assert [(label, d) for label, d, _ in decisions(strategy)] == [
        ("ZeRO stage 3", "explored"), ("ZeRO stage 3 + offload optimizer", "probed"),
        ("ZeRO stage 3 + offload optimizer+params", "probed")]
    assert strategy.result.stages[1].reason == ("memory model: largest mbs 17 (without it: 5); probe at mbs=17: ok "
                                                "5.965, not better than ZeRO stage 3's 6.667 at mbs=5")
    assert strategy.result.answer.name == "z3_gas1_tmbspg5"


def test_on_cpu_ranks_offload_to_the_host_is_not_tried(tmp_path):
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_PAYS[saver], cpu=True)
    assert all(saver == "" for _, saver, _ in ran)
    assert [r.label for r in strategy.result.stages] == ["ZeRO stage 3"]
    assert strategy.result.savers_notes == ["offload to the host: not tried on CPU ranks (the host is the rank: what "
                                            "it moves stays in the rank's budget)"]


def test_a_stage_whose_best_is_below_its_largest_runnable_mbs_tries_no_saver(tmp_path):
    # a step of 0.01 s + 0.5 s per sample, 5% more per sample from mbs 3: mbs 2 (3.96 samples/s) beats mbs 5
    # (3.80), so memory does not bind ZeRO-3 and no saver is visited. Mbs 5 peaks near the capacity, so the
    # halving below it is off the affine curve and runs (of unknown peak it would not: at most a 2.2% gain)
    ran, strategy = tune(tmp_path, lambda mbs, saver: 0.01 + 0.5 * mbs * (1.05 if mbs >= 3 else 1.0)
                         + OFFLOAD_PAYS[saver], peaks=True)
    assert ran[:2] == [(5, "", "ok"), (2, "", "ok")] and all(saver == "" for _, saver, _ in ran)
    assert [r.label for r in strategy.result.stages] == ["ZeRO stage 3"]
    assert strategy.result.answer.name == "z3_gas1_tmbspg2"
    assert strategy.result.savers_notes == [NOT_BOUND]


NOT_BOUND = ("memory savers (activation checkpointing, offload): not tried: memory binds no stage (the best stage's "
             "best mbs is below its largest runnable one or at the largest allowed, and every stage without a run was "
             "skipped by the stage rules)")


def test_a_stage_at_the_largest_allowed_mbs_tries_no_saver_and_the_summary_says_so(tmp_path):
    # ZeRO-3 fits mbs 5 but the config allows 4, which runs: memory binds no stage, so neither checkpointing (the
    # script takes it) nor offload is visited, and the summary says why
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_PAYS[saver], max_mbs=4,
                         checkpointing=True)
    assert ran[0] == (4, "", "ok") and all(saver == "" for _, saver, _ in ran), ran
    assert [r.label for r in strategy.result.stages] == ["ZeRO stage 3"]
    assert strategy.result.answer.name == "z3_gas1_tmbspg4"
    assert strategy.result.savers_notes == [NOT_BOUND]


def test_with_no_savers_none_is_visited_and_the_summary_says_so(tmp_path):
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_PAYS[saver], savers=False)
    assert ran == [(5, "", "ok"), (5, "", "ok")]  # the answer re-measured
    assert [r.label for r in strategy.result.stages] == ["ZeRO stage 3"]
    assert strategy.result.savers_notes == ["memory savers (activation checkpointing, offload): off (--no-savers)"]


def test_nvme_offload_runs_where_the_host_cannot_hold_the_cpu_offload(tmp_path):
    # 2 ranks per node offload 3.0e9 bytes each to the host (the optimizer) or 3.6e9 (with the parameters): a
    # 4 GiB host holds neither, so both cpu offloads are pruned; to NVMe they fit the same mbs (17, 19) on the
    # device and are launched (offload to NVMe: step + 2 s)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    costs = {"": 0.0, "offload_optimizer:nvme": 2.0, "offload_optimizer:nvme+offload_param:nvme": 2.5}
    ran, strategy = tune(tmp_path / "t", lambda mbs, saver: 1 + 0.1 * mbs + costs[saver], host_memory_bytes=4 * GiB,
                         nvme_path=str(nvme))
    assert [(label, d) for label, d, _ in decisions(strategy)] == [
        ("ZeRO stage 3", "explored"), ("ZeRO stage 3 + offload optimizer", "pruned"),
        ("ZeRO stage 3 + offload optimizer+params", "pruned"), ("ZeRO stage 3 + offload optimizer (nvme)", "explored"),
        ("ZeRO stage 3 + offload optimizer+params (nvme)", "probed")]
    assert strategy.result.stages[1].reason == "memory model: the host memory cannot hold what it offloads"
    assert ran[1] == (17, "offload_optimizer:nvme", "ok")
    answer = strategy.result.answer.ds_config["zero_optimization"]["offload_optimizer"]
    assert answer == {"device": "nvme", "nvme_path": str(nvme)}


def test_an_nvme_path_that_is_not_a_directory_is_exit_2_naming_it(tmp_path):
    make_job(tmp_path)  # writes ds.json
    out = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "8GiB",
                          "--nvme-path", str(tmp_path / "missing"), "--dry-run", str(tmp_path / "train.py"),
                          "--deepspeed_config", str(tmp_path / "ds.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--nvme-path {tmp_path / 'missing'}: not a directory" in out.stderr, out.stderr


BF16_COSTS = {"": 0.0, "bf16 states": 0.0, "offload_optimizer": 3.0, "offload_optimizer+offload_param": 3.5}


def test_bf16_states_opted_into_are_the_first_saver_and_win_where_memory_binds(tmp_path):
    # bf16 weights: ZeRO-3 fits mbs 14; with bf16 master weights, gradients and Adam states (6 bytes a parameter
    # less, over 2 ranks) 18, at no cost per sample: 2*18/2.8 = 12.86 samples/s beats 11.67, so it is searched and
    # is the answer; the offloads fit more (24, 25) and cost 3 s a step: each probed once and lost
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + BF16_COSTS[saver],
                         bf16={"enabled": True, "allow": True})
    assert ran[:4] == [(14, "", "ok"), (18, "bf16 states", "ok"), (24, "offload_optimizer", "ok"),
                       (25, "offload_optimizer+offload_param", "ok")]
    assert decisions(strategy) == [("ZeRO stage 3", "explored", 14), ("ZeRO stage 3 + bf16 states", "explored", 18),
                                   ("ZeRO stage 3 + offload optimizer", "probed", 24),
                                   ("ZeRO stage 3 + offload optimizer+params", "probed", 25)]
    assert strategy.result.stages[1].reason == ("memory model: largest mbs 18 (without it: 14); probe at mbs=18 beat "
                                                "the best (12.86 > 11.67, ZeRO stage 3)")
    assert strategy.result.answer.name == "z3_gas1_tmbspg18_bf1_mwbf1_osbf1"
    assert strategy.result.answer.ds_config["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                                                        "bf16_optimizer_states": True}


def test_bf16_states_not_opted_into_are_not_tried_and_the_summary_says_where_they_would_fit(tmp_path):
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + BF16_COSTS[saver], bf16={"enabled": True})
    assert all("bf16" not in saver for _, saver, _ in ran)
    assert strategy.result.answer.name == "z3_gas1_tmbspg14_bf1"
    assert strategy.result.savers_notes == [
        "bf16 states (bf16_master_weights_and_grads, bf16_optimizer_states): not tried at ZeRO stage 3, where the "
        "memory model fits mbs=18 with them (without: 14); they change the numerics: "
        "autotuning.allow_reduced_precision_states: true lets zerotune try them"]


def test_bf16_states_go_only_on_an_enabled_bf16_section_without_an_offloaded_optimizer():
    assert [s.name for s in savers_for(3, False, bf16_states=True)][:1] == ["bf16 states"]
    assert [s.name for s in savers_for(0, False, bf16_states=True)] == []  # DeepSpeed: ZeRO stages 1-3 only
    assert bf16_states_apply({"bf16": {"enabled": True}}) and bf16_states_apply({"bf16": {"enabled": "auto"}})
    assert not bf16_states_apply({"fp16": {"enabled": True}}) and not bf16_states_apply({"bf16": {"enabled": False}})
    assert not bf16_states_apply({"bfloat16": {"enabled": True}})
    # an offloaded optimizer needs DeepSpeedCPUAdam built for bf16 states, which zerotune cannot build
    assert not bf16_states_apply({"bf16": {"enabled": True},
                                  "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert bf16_states_apply({"bf16": {"enabled": True}, "zero_optimization": {"offload_optimizer": {"device": "none"}}})


TP_COSTS = {"": 0.0, "tp2": 0.2, "offload_optimizer": 3.0}


def test_a_listed_autotp_degree_is_a_saver_of_stages_0_to_2_tried_where_memory_binds(tmp_path):
    # fp32 ZeRO-1 on 2 ranks fits mbs 6; AutoTP 2 halves the parameters and what ZeRO-1 partitions over 2 / 2 ranks:
    # mbs 11 fits, 2*11/2.3 = 9.565 samples/s beats 7.5, so it is searched and is the answer; offloading the
    # optimizer fits 15 but costs 3 s a step (6.667): probed once and lost
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + TP_COSTS[saver],
                         extra={"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": [1, 2]}})
    assert ran[:3] == [(6, "", "ok"), (11, "tp2", "ok"), (15, "offload_optimizer", "ok")]
    assert decisions(strategy) == [("ZeRO stage 1", "explored", 6), ("ZeRO stage 1 + autotp 2", "explored", 11),
                                   ("ZeRO stage 1 + offload optimizer", "probed", 15)]
    assert strategy.result.stages[1].reason == ("memory model: largest mbs 11 (without it: 6); probe at mbs=11 beat "
                                                "the best (9.565 > 7.5, ZeRO stage 1)")
    assert strategy.result.answer.name == "z1_gas1_tmbspg11_tp2"
    assert [s.name for s in savers_for(3, False, autotp=(2,))] == ["offload optimizer", "offload optimizer+params"]


def test_bf16_states_opted_into_are_probed_at_the_best_mbs_where_memory_binds_nothing(tmp_path):
    # ZeRO-3 fits mbs 14 and the config allows 4: memory binds no stage, yet bf16 states make the optimizer step
    # cheaper (here 0.2 s less a step): one probe at the best mbs, 8/1.2 = 6.667 > 8/1.4 = 5.714 samples/s, wins
    costs = {"": 0.0, "bf16 states": -0.2}
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + costs[saver], max_mbs=4,
                         bf16={"enabled": True, "allow": True})
    assert ran[:2] == [(4, "", "ok"), (4, "bf16 states", "ok")]
    assert decisions(strategy)[1] == ("ZeRO stage 3 + bf16 states", "explored", 4)  # capped at the largest allowed
    assert strategy.result.stages[1].reason == (
        "memory binds no stage; a faster optimizer step: probed at the best mbs=4 (memory model: largest mbs 4); "
        "beat the best (6.667 > 5.714)")
    assert strategy.result.answer.name == "z3_gas1_tmbspg4_bf1_mwbf1_osbf1"
    # where they are no faster, the one probe loses and the answer stays
    ran, strategy = tune(tmp_path / "same", lambda mbs, saver: 1 + 0.1 * mbs, max_mbs=4,
                         bf16={"enabled": True, "allow": True})
    assert [(label, d) for label, d, _ in decisions(strategy)] == [("ZeRO stage 3", "explored"),
                                                                   ("ZeRO stage 3 + bf16 states", "probed")]
    assert strategy.result.answer.name == "z3_gas1_tmbspg4_bf1"


def test_a_savers_reason_gives_the_stages_largest_mbs_as_the_fit_stands_not_its_first_estimate(tmp_path):
    # the device holds 7.5 GiB of the 8 GiB budget: ZeRO-3's first estimate, mbs 5, runs out of memory, then 2 and 1,
    # and the refitted model fits none; offloading the optimizer is reported against that, not against the 5
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + OFFLOAD_PAYS[saver], capacity=int(7.5 * GiB))
    assert ran[:3] == [(5, "", "oom"), (2, "", "oom"), (1, "", "oom")]
    assert decisions(strategy)[:2] == [("ZeRO stage 3", "explored", 5), ("ZeRO stage 3 + offload optimizer", "explored",
                                                                         17)]
    assert strategy.result.stages[1].reason == ("memory model: largest mbs 17 (without it: none); searched: no config "
                                                "without a saver ran")


def test_with_no_savers_the_listed_autotp_degrees_are_not_tried_and_the_summary_says_so(tmp_path):
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + TP_COSTS[saver], savers=False,
                         extra={"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": [2, 1]}})
    assert all(saver == "" for _, saver, _ in ran)
    assert strategy.result.savers_notes == [
        "memory savers (activation checkpointing, offload): off (--no-savers); tensor_parallel.autotp_size 2: not "
        "tried (a saver)"]


SP_COSTS = {"": 0.0, "sp2": 0.3, "sp4": 0.6, "offload_optimizer": 3.0}


def test_a_listed_ulysses_degree_is_a_saver_where_no_mbs_fits_a_whole_sequence(tmp_path):
    # 3 GiB of activations per sample (a long sequence): fp32 ZeRO-1 on 2 ranks fits no mbs in 8 GiB; Ulysses 2 holds
    # half of each sequence on a rank (1.5 GiB, what the profile, run at the largest degree, measures) and fits mbs 1,
    # its 2 ranks one replica: 1 / 1.8 = 0.5556 samples/s; offloading the optimizer fits mbs 1 too, 2 / 4.5 = 0.4444:
    # probed and lost
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.5 * mbs + SP_COSTS[saver], activations=3 * GiB // 2,
                         extra={"zero_optimization": {"stage": 1}, "sequence_parallel_size": [1, 2]})
    assert strategy.builder.profile().ds_config["sequence_parallel_size"] == 2
    assert ran[:2] == [(1, "sp2", "ok"), (1, "offload_optimizer", "ok")]
    assert decisions(strategy) == [("ZeRO stage 1", "pruned", 0), ("ZeRO stage 1 + sp 2", "explored", 1),
                                   ("ZeRO stage 1 + offload optimizer", "probed", 1)]
    assert strategy.result.stages[1].reason == ("memory model: largest mbs 1 (without it: none); searched: no config "
                                                "without a saver ran")
    assert strategy.result.answer.name == "z1_gas1_tmbspg1_sp2"
    assert strategy.result.answer.ds_config["train_batch_size"] == 1  # one replica of 2 ranks
    ran, strategy = tune(tmp_path / "off", lambda mbs, saver: 1 + 0.5 * mbs + SP_COSTS[saver], activations=3 * GiB // 2,
                         savers=False, extra={"zero_optimization": {"stage": 1}, "sequence_parallel_size": [1, 2]})
    assert ran == [] and strategy.result.savers_notes == [
        "memory savers (activation checkpointing, offload): off (--no-savers); sequence_parallel_size 2: not tried "
        "(a saver)"]


def test_where_the_best_offloads_the_whole_optimizer_the_largest_share_that_fits_its_mbs_stays_on_the_device(tmp_path):
    # ZeRO-3 fits mbs 5; offloading the optimizer fits the largest allowed, 8, and wins (16/2.3 = 6.957 > 6.667); with
    # sub_group_size 5e7 a rank's 150M parameters are 3 sub-groups: 2 kept on the device (ratio 0.1667, DeepSpeed
    # keeping int(0.8333 * 3) = 2) still fit mbs 8, and their faster step, 16/1.9 = 8.421, is the answer
    costs = {"": 0.0, "offload_optimizer": 0.5, "offload_optimizer ratio 0.1667": 0.1}
    ran, strategy = tune(tmp_path, lambda mbs, saver: 1 + 0.1 * mbs + costs[saver],
                         max_mbs=8, extra={"zero_optimization": {"stage": 3, "sub_group_size": 50_000_000}})
    assert ran[:3] == [(5, "", "ok"), (8, "offload_optimizer", "ok"), (8, "offload_optimizer ratio 0.1667", "ok")]
    assert decisions(strategy)[-1] == ("ZeRO stage 3 + offload optimizer ratio 0.1667", "explored", 8)
    assert strategy.result.stages[-1].reason == (
        "the best offloads the whole optimizer; 2 of its 3 sub-groups a rank kept on the device fit mbs=8 (memory "
        "model: largest mbs 8): probed there; beat the best (8.421 > 6.957)")
    assert strategy.result.answer.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu",
                                                                                         "ratio": 0.1667}
    # without the cap the best offloaded mbs is 17, where no share fits: said, not launched
    ran, strategy = tune(tmp_path / "free", lambda mbs, saver: 1 + 0.1 * mbs + costs.get(saver, 1.0),
                         extra={"zero_optimization": {"stage": 3, "sub_group_size": 50_000_000}})
    assert all("ratio" not in saver for _, saver, _ in ran)
    assert strategy.result.savers_notes == [
        "offload_optimizer.ratio: not tried on ZeRO stage 3 + offload optimizer: no share of its 3 sub-groups a rank "
        "kept on the device fits mbs=17 by the memory model"]
