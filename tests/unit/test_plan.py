"""The dry run (``zerotune tune --dry-run``): which experiments, what memory, nothing launched."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import ACTIVATIONS, PARAMS, SCRIPT, write_dry_run_config
from zerotune.autotuner import Autotuner, TuneOptions
from zerotune.core.experiment import Status
from zerotune.inputs.configs import ConfigBuilder
from zerotune.model.memory import MemoryModel
from zerotune.report.results import table_text
from zerotune.run.exprecord import write_record
from zerotune.run.resources import select_resources
from zerotune.run.resume import resume_context, resume_key

GiB = 2**30


def tuner(tmp_path: Path, config: Path, budget: int = int(2.5 * GiB), cpu: bool = True) -> Autotuner:
    nodes = select_resources(None, "", "", -1, -1, 2)
    return Autotuner(SCRIPT, ["--deepspeed_config", str(config)], nodes,
                     TuneOptions(device_memory_bytes=budget, results_dir=str(tmp_path / "results"), cpu=cpu))


PROFILE = "profile_z1_gas1_tmbspg1_rbs1e7"  # the job tunes stages 0-1: the profile runs at 1


def test_plan_from_autotuning_model_info_runs_the_strategy_on_the_memory_model(tmp_path):
    plan = tuner(tmp_path, write_dry_run_config(tmp_path / "ds.json")).plan()
    assert plan.model_info_source == "autotuning.model_info"
    # everything fits 2.5 GiB: ZeRO-0 starts at its estimate, the cap (8), halves once (4: slower); ZeRO-1 has
    # no more headroom, so one probe at mbs 8, a tie within the precision under the oracle's assumed metric (never
    # re-measured, and at equal mbs not a win); the fine pass bisects nothing below ZeRO-0's best, the best stage
    # (on CPU ranks the throughput model gates no mbs below its family's largest, but mbs 4 reads so far under 8 that
    # nothing between them beats 8 by more than a tie, D311), and gas doubles once at the best mbs (the global batch
    # is free)
    assert [e.name for e in plan.experiments] == [
        PROFILE, "z0_gas1_tmbspg8", "z0_gas1_tmbspg4", "z1_gas1_tmbspg8_rbs2e7", "z0_gas2_tmbspg8"]
    assert not any(e.skipped for e in plan.experiments)
    z1 = plan.experiments[3]
    assert (z1.phase, z1.stage, z1.mbs, z1.gas, z1.knobs) == ("mbs", 1, 8, 1, {})
    # fp32 AdamW, ZeRO-1, N=2: params 4Ψ + grads (4Ψ + 4Ψ/2) + optimizer (8+4)Ψ/2 + bucket 4*2e7 + the
    # reduction's flat copy 4*min(2e7, Ψ) + activations, less the copy (made after the backward, without
    # overlap_comm, when the activations are freed: the peak holds the larger of the two)
    assert z1.memory_bytes == (4 * PARAMS + (4 * PARAMS + 2 * PARAMS) + 6 * PARAMS + 80_000_000 + 4 * PARAMS - 4 * PARAMS
                               + 8 * ACTIVATIONS)
    assert z1.memory_bytes == 513_348_608
    assert z1.fits is True
    assert z1.ds_config["train_batch_size"] == 16
    assert not (tmp_path / "results").exists()  # a dry run writes nothing


def test_plan_follows_the_search_to_the_memory_boundary(tmp_path):
    # 300 MiB per device: ZeRO-0 (4Ψ+4Ψ+8Ψ+4Ψ buffer = 105.8 MB, the buffer being the reduction's flat copy
    # made after the backward, when the activations are freed: they share its 21.2 MB) fits to mbs 5,
    # ZeRO-1 (fixed 185.7 MB with the same copy) to mbs 3
    plan = tuner(tmp_path, write_dry_run_config(tmp_path / "ds.json"), budget=300 * 2**20).plan()
    rows = {e.name: e for e in plan.experiments}
    # the search starts on the estimate 5, tries one step above it (8: OOM), bisects (6: OOM), halves once
    # (2: slower), then the fine pass tries 3 and 4; ZeRO-1 is probed at its own largest mbs, 3, and does not
    # beat ZeRO-0 there; gas doubles at the best mbs
    assert [(e.mbs, e.gas) for e in plan.experiments if e.stage == 0] == [
        (5, 1), (8, 1), (6, 1), (2, 1), (3, 1), (4, 1), (5, 2)]
    assert [rows[f"z0_gas1_tmbspg{m}"].fits for m in (5, 8, 6)] == [True, False, False]
    assert rows["z0_gas1_tmbspg5"].memory_bytes == 20 * PARAMS - 4 * PARAMS + 5 * ACTIVATIONS
    assert [n for n in rows if n.startswith("z1")] == ["z1_gas1_tmbspg3_rbs2e7"]
    assert "6 fit 300.00 MiB per device" in plan.header()  # 5, 2, 3, 4 and 5 at gas 2 of ZeRO-0, 3 of ZeRO-1


def test_plan_on_gpu_ranks_shows_what_the_throughput_model_would_not_launch(tmp_path):
    # the same search on GPU ranks (300 MiB devices): the halving below the best (2) is bounded by mbs 5's reading
    # under the oracle's assumed metric (perfect scaling), which it cannot beat by more than the precision: not
    # launched, and neither is the fine pass below it (nothing below the best ran)
    plan = tuner(tmp_path, write_dry_run_config(tmp_path / "ds.json"), budget=300 * 2**20, cpu=False).plan()
    assert [(e.mbs, e.gas) for e in plan.experiments if e.stage == 0] == [(5, 1), (8, 1), (6, 1), (2, 1), (5, 2)]
    assert [e.name for e in plan.experiments if e.skipped] == ["z0_gas1_tmbspg2"]
    (skipped,) = [e for e in plan.experiments if e.skipped]
    assert skipped.skipped.startswith("throughput model: ") and skipped.skipped.endswith("not launched")
    assert "z0_gas1_tmbspg2: throughput model" in table_text(plan.table())
    assert "; 1 not launched by the throughput model" in plan.header()

def test_plan_with_fast_false_lists_the_knob_phase_the_tuner_would_walk(tmp_path):
    path = write_dry_run_config(tmp_path / "ds.json", fast=False, reduce_bucket_size=[20_000_000, 50_000_000])
    cfg = json.loads(path.read_text())
    cfg["zero_optimization"]["stage"] = 1
    cfg["gradient_accumulation_steps"] = [1]  # gas held at 1: a one-value list
    path.write_text(json.dumps(cfg))
    plan = tuner(tmp_path, path).plan()
    knobs = [e for e in plan.experiments if e.phase == "knobs" and not e.name.endswith("_r2")]
    # the user's 2 reduce bucket sizes x 3 default allgather bucket sizes at the best mbs (8); the one that
    # is the mbs phase's own config (rbs 2e7, agbs 5e8 = DeepSpeed's default) is not listed again
    assert [e.name for e in knobs] == ["z1_gas1_tmbspg8_rbs2e7_agbs5e7", "z1_gas1_tmbspg8_rbs5e7_agbs5e7",
                                       "z1_gas1_tmbspg8_rbs5e7", "z1_gas1_tmbspg8_rbs2e7_agbs1e9",
                                       "z1_gas1_tmbspg8_rbs5e7_agbs1e9"]
    assert knobs[0].knobs == {"zero_optimization.reduce_bucket_size": 20_000_000,
                              "zero_optimization.allgather_bucket_size": 50_000_000}
    assert knobs[1].memory_bytes - knobs[0].memory_bytes == 4 * 30_000_000  # the larger reduce bucket
    assert len({e.name for e in plan.experiments}) == len(plan.experiments)
    # the configs tied with the best (the oracle scores them alike) are ties within the precision: no second run
    # before the answer; with "fast": false the answer itself is measured twice
    assert [e.name for e in plan.experiments][-2:] == ["z1_gas1_tmbspg8_rbs5e7_agbs1e9", "z1_gas1_tmbspg8_rbs2e7_r2"]


def test_plan_without_model_size_leaves_memory_unknown(tmp_path):
    plan = tuner(tmp_path, write_dry_run_config(tmp_path / "ds.json", model_info=False)).plan()
    assert plan.model_info_source is None
    assert all(e.memory_bytes is None and e.fits is None for e in plan.experiments)
    # the probe a tie (not re-measured), no fine pass (mbs 4 is a clear loss); then gas 2 at 8
    assert [(e.mbs, e.gas) for e in plan.experiments if e.stage == 0] == [(8, 1), (4, 1), (8, 2)]
    assert "unknown until the profile run" in plan.header()


def test_plan_uses_a_finished_profile_run_on_disk(tmp_path):
    config = write_dry_run_config(tmp_path / "ds.json", model_info=False)
    t = tuner(tmp_path, config)
    profile = ConfigBuilder(t.job).profile()
    assert profile.name == PROFILE
    profile.status, profile.peak_memory_bytes = Status.OK, 400 * 2**20
    profile.metrics = {"num_params": PARAMS, "activation_mem_per_gpu": ACTIVATIONS}
    exp_dir = t.job.exps_dir / profile.name
    exp_dir.mkdir(parents=True)
    context = resume_context(t.job)  # the record of this job's own profile run
    write_record(profile, exp_dir, resume_key(profile.ds_config, context), context)
    plan = t.plan()
    assert plan.model_info_source == "profile run on disk"
    assert plan.experiments[0].name == "z0_gas1_tmbspg8"  # the profile is not listed again
    # calibrated on the profile's peak: the fixed per-rank overhead is what the estimate of the profile
    # run (which exits in its first forward, before the optimizer states exist) missed there
    bare = MemoryModel(PARAMS, ACTIVATIONS, dp_world_size=2)
    overhead = 400 * 2**20 - bare.profile_exit_bytes(profile.ds_config)
    assert overhead > 0
    z0 = plan.experiments[0]
    assert z0.memory_bytes == bare.bytes_per_device(z0.ds_config) + overhead


def test_cli_dry_run_json_launches_nothing(tmp_path):
    config = write_dry_run_config(tmp_path / "ds.json")
    out = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "2.5GiB",
                          "--results-dir", str(tmp_path / "results"), "--dry-run", "--json", SCRIPT,
                          "--deepspeed_config", str(config)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["device_memory_bytes"] == int(2.5 * GiB) and data["dp_world_size"] == 2
    assert [e["name"] for e in data["experiments"]][:2] == [PROFILE, "z0_gas1_tmbspg8"]
    # at mbs 8; the reduction's copy 4Ψ is made after the activations are freed
    assert data["experiments"][1]["memory_bytes"] == 16 * PARAMS + 8 * ACTIVATIONS == 433_348_608
    assert not (tmp_path / "results").exists()


def test_cli_json_without_dry_run_is_a_usage_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zerotune", "tune", "--num_gpus", "2", "--device-memory", "2.5GiB",
                          "--json", SCRIPT, "--deepspeed_config", str(write_dry_run_config(tmp_path / "ds.json"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--json goes with --dry-run" in out.stderr


def test_bad_model_info_is_an_error_naming_the_key(tmp_path):
    path = tmp_path / "ds.json"
    cfg = json.loads(write_dry_run_config(path).read_text())
    cfg["autotuning"]["model_info"]["activation_mem_per_gpu"] = "40MB"
    path.write_text(json.dumps(cfg))
    from zerotune.core.errors import ConfigError
    with pytest.raises(ConfigError, match=r"autotuning.model_info.activation_mem_per_gpu' = '40MB'"):
        tuner(tmp_path, path).plan()


def offload_config(path: Path) -> Path:
    cfg = json.loads(write_dry_run_config(path).read_text())
    cfg["zero_optimization"] = {"stage": [0, 2], "reduce_bucket_size": 20_000_000,
                                "offload_optimizer": {"device": "cpu"}}
    path.write_text(json.dumps(cfg))
    return path


def test_a_stage_whose_offload_overflows_the_nodes_host_memory_is_pruned(tmp_path, caplog):
    """GPU ranks: offload's host bytes (fp32 gradient partition 4Ψ/N, master 4Ψ/N, Adam 8Ψ/N per rank)
    times the ranks of a node must fit the node's host memory, or the stage is never launched."""
    nodes = select_resources(None, "", "", -1, -1, 2)
    host_per_rank = 16 * PARAMS // 2
    lines = []

    def plan(host_memory):
        t = Autotuner(SCRIPT, ["--deepspeed_config", str(offload_config(tmp_path / "ds.json"))], nodes,
                      TuneOptions(device_memory_bytes=int(2.5 * GiB), results_dir=str(tmp_path / "results"), cpu=False,
                                  host_memory_bytes=host_memory))
        planned = t.plan()
        lines.extend(caplog.messages)  # the strategy's log lines (zerotune.report.log)
        return {e.stage for e in planned.experiments if e.phase != "profile"}

    assert plan(2 * host_per_rank) == {0, 2}
    assert plan(2 * host_per_rank - 1) == {0}
    assert any("ZeRO stage 2: does not fit (offload needs 80.71 MiB of host memory per node, the node has 80.71 MiB)"
               in line for line in lines), lines


def test_on_cpu_ranks_offload_counts_against_the_per_rank_budget(tmp_path):
    """CPU ranks: what offload moves to the "host" stays in the rank (RLIMIT_DATA counts it)."""
    plan = tuner(tmp_path, offload_config(tmp_path / "ds.json")).plan()
    z2 = next(e for e in plan.experiments if e.stage == 2 and e.phase != "profile")  # the profile runs at 2 too
    model = MemoryModel(PARAMS, ACTIVATIONS, 2)
    on_cpu = MemoryModel(PARAMS, ACTIVATIONS, 2, host_on_device=True)
    config = ConfigBuilder(tuner(tmp_path, offload_config(tmp_path / "ds.json")).job).mbs_experiment(2, z2.mbs).ds_config
    assert z2.memory_bytes == on_cpu.bytes_per_device(config) == model.bytes_per_device(config) + 16 * PARAMS // 2


def test_a_bad_host_memory_is_exit_2_naming_it(tmp_path, capsys):
    from zerotune import cli
    argv = ["tune", "--num_gpus", "2", "--device-memory", "2GiB", "--host-memory", "lots", "--dry-run",
            "--results-dir", str(tmp_path / "r"), SCRIPT,
            "--deepspeed_config", str(write_dry_run_config(tmp_path / "ds.json"))]
    assert cli.main(argv) == 2
    assert "--host-memory = 'lots': expected a size such as 3GiB" in capsys.readouterr().err
