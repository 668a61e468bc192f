"""The skip rule (zerotune.strategy.prediction): which candidates the throughput model keeps from launching, with
what bounds and reason, on given readings and through the Strategy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.inputs.job import Job, TuneOptions
from zerotune.model.throughput import Reading
from zerotune.run.resources import select_resources
from zerotune.strategy.prediction import GATED_KINDS, Prediction, family_key, predict
from zerotune.strategy.tuning import Strategy

GiB = 2**30


def config(mbs: int, gas: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": 0}}


def candidate(mbs: int, gas: int = 1, kind: ExperimentKind = ExperimentKind.MBS) -> Experiment:
    return Experiment(f"z0_gas{gas}_tmbspg{mbs}", config(mbs, gas), kind=kind)


def family(*readings: Reading, gas: int = 1) -> dict:
    return {family_key(config(1, gas)): list(readings)}


SCALING = family(Reading(16, 160.0, 0.02), Reading(32, 320.0, 0.02))  # perfect scaling: tau(m) = 0.1 s


def test_a_smaller_mbs_on_a_scaling_family_is_skipped_with_its_bounds_and_reason():
    p = predict(candidate(24), SCALING, ("z0_gas1_tmbspg32", 320.0), 0.02)
    assert isinstance(p, Prediction)
    assert (p.name, p.best, p.best_name, p.precision) == ("z0_gas1_tmbspg24", 320.0, "z0_gas1_tmbspg32", 0.02)
    # the slowest curve through both intervals is tau(24) = 0.1 / 0.98 s, the fastest 0.1 / 1.02 s: 240 x 0.98..1.02
    assert p.low == pytest.approx(235.2, rel=1e-12) and p.high == pytest.approx(244.8, rel=1e-12)
    assert p.reason == ("throughput model: 235.2-244.8 samples/s predicted (2 run(s) of its family, affine step "
                        "time); cannot beat z0_gas1_tmbspg32's 320 by more than the precision (2%): not launched")


def test_a_larger_mbs_is_launched_where_perfect_scaling_from_a_reading_beats_the_best():
    # one reading at mbs 16: mbs 32 may reach 160 x 1.02 x 2 = 326.4 (a = 0), beyond 160 x 1.02
    assert predict(candidate(32), family(Reading(16, 160.0, 0.02)), ("z0_gas1_tmbspg16", 160.0), 0.02) is None
    # the same bound against a best of 320.1: 326.4 beats it by 1.97%, within the precision: skipped
    p = predict(candidate(32), family(Reading(16, 160.0, 0.02)), ("other", 320.1), 0.02)
    assert p is not None and p.high == pytest.approx(326.4, rel=1e-12) and p.low == pytest.approx(156.8, rel=1e-12)


def test_a_family_no_affine_step_time_fits_does_not_bound_its_candidates():
    # mbs 16 takes 0.16 s a step and mbs 32 0.1 s: a step time falling with mbs beyond the noise; the model does not
    # apply, and mbs 24 is launched although mbs 32 is the best
    falling = family(Reading(16, 100.0, 0.01), Reading(32, 320.0, 0.01))
    assert predict(candidate(24), falling, ("z0_gas1_tmbspg32", 320.0), 0.02) is None


def test_a_gas_candidate_with_no_run_of_its_family_is_bounded_by_the_roofline_of_a_measured_family():
    # gas 1 reads 100 samples/s at mbs 8 and 16, each +-1%: the smallest slope of tau through both intervals is
    # (0.16 / 1.01 - 0.08 / 0.99) / 8 s per sample, a roofline of 103.08 samples/s
    flat = family(Reading(8, 100.0, 0.01), Reading(16, 100.0, 0.01))
    gas2 = candidate(16, gas=2, kind=ExperimentKind.GAS)
    roofline = 8 / (0.16 / 1.01 - 0.08 / 0.99)
    assert roofline == pytest.approx(103.08, abs=0.005)
    # against a best of 100: the roofline beats 102 (100 plus the precision): launched
    assert predict(gas2, flat, ("z0_gas1_tmbspg16", 100.0), 0.02) is None
    # against a best of 101.5: it does not beat 103.53: skipped, its low bound 0 (nothing bounds it from below)
    p = predict(gas2, flat, ("z0_gas1_tmbspg16", 101.5), 0.02)
    assert p is not None and (p.name, p.low, p.best) == ("z0_gas2_tmbspg16", 0.0, 101.5)
    assert p.high == pytest.approx(roofline, rel=1e-9)
    assert p.reason == ("throughput model: 0-103.1 samples/s predicted (the compute roofline of a measured family); "
                        "cannot beat z0_gas1_tmbspg16's 101.5 by more than the precision (2%): not launched")
    # a family with one mbs gives no roofline: the gas candidate is launched
    assert predict(gas2, family(Reading(16, 100.0, 0.01)), ("z0_gas1_tmbspg16", 101.5), 0.02) is None


def test_only_mbs_and_gas_candidates_with_a_best_are_gated():
    assert GATED_KINDS == (ExperimentKind.MBS, ExperimentKind.GAS)
    assert predict(candidate(24, kind=ExperimentKind.KNOBS), SCALING, ("z0_gas1_tmbspg32", 320.0), 0.02) is None
    assert predict(candidate(24), SCALING, None, 0.02) is None  # no best yet


def make_job(tmp_path: Path, metric: str = "throughput", cpu: bool = False) -> Job:
    """ZeRO stage 0 only, mbs 1..32, 2 ranks of 8 GiB (GPU ranks unless ``cpu``), tuning ``metric``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                       "zero_optimization": {"stage": 0},
                                       "autotuning": {"enabled": True, "fast": True, "metric": metric,
                                                      "max_train_micro_batch_size_per_gpu": 32}}))
    return Job.build(str(tmp_path / "train.py"), ["--deepspeed_config", str(config_file)],
                     select_resources(local_slots=2),
                     TuneOptions(device_memory_bytes=8 * GiB, results_dir=str(tmp_path / "results"), cpu=cpu))


def tune(tmp_path: Path, curve, metric: str = "throughput", cpu: bool = False, oom_above: int | None = None) -> Strategy:
    """The Strategy with ``curve(mbs, gas)`` as every run's metric, known to +-1%; a run above ``oom_above`` (None:
    none) runs out of memory."""
    def evaluate(exps):
        for exp in exps:
            profile = exp.kind is ExperimentKind.PROFILE
            exp.status = Status.OOM if oom_above is not None and exp.mbs > oom_above and not profile else Status.OK
            if not profile and exp.status is Status.OK:
                exp.metric, exp.metric_rel_half_width = curve(exp.mbs, exp.gas), 0.01
        return exps

    strategy = Strategy(make_job(tmp_path, metric, cpu), evaluate)
    strategy.run()
    return strategy


def test_the_strategy_launches_only_what_the_throughput_model_cannot_rule_out(tmp_path):
    # perfect scaling in mbs, 2% faster at gas 2, out of memory above mbs 26: mbs 32 (the cap) fails, 16 runs, the
    # bisection runs 24, 28 (fails), 26, 27 (fails); at the memory boundary the fine pass bisects below the best, and
    # its mbs 25 is bounded by mbs 16, 24 and 26 under 260 plus the precision: skipped, never launched; gas 2 at mbs
    # 26 has no run of its family and the gas 1 family shows no finite roofline (all of its step time may be
    # per-step): launched
    def curve(mbs, gas):
        return 10.0 * mbs * (1.02 if gas == 2 else 1.0)
    strategy = tune(tmp_path, curve, oom_above=26)
    assert [(e.name, e.status.value) for e in strategy.result.experiments] == [
        ("profile_z0_gas1_tmbspg1", "ok"), ("z0_gas1_tmbspg32", "oom"), ("z0_gas1_tmbspg16", "ok"),
        ("z0_gas1_tmbspg24", "ok"), ("z0_gas1_tmbspg28", "oom"), ("z0_gas1_tmbspg26", "ok"),
        ("z0_gas1_tmbspg27", "oom"), ("z0_gas1_tmbspg25", "skipped"), ("z0_gas2_tmbspg26", "ok")]
    (skipped,) = [e for e in strategy.result.experiments if e.status is Status.SKIPPED]
    (prediction,) = strategy.result.predictions
    assert skipped.metric is None and skipped.error == prediction.reason == (
        "throughput model: 244.4-255.6 samples/s predicted (3 run(s) of its family, affine step time); cannot beat "
        "z0_gas1_tmbspg26's 260 by more than the precision (2%): not launched")
    assert strategy.best_batch == {0: (26, 2)}
    # on CPU ranks a smaller mbs than the family's largest is never gated (caches can make it faster): mbs 25 runs
    on_cpu = tune(tmp_path / "cpu", curve, cpu=True, oom_above=26)
    assert ("z0_gas1_tmbspg25", "ok") in [(e.name, e.status.value) for e in on_cpu.result.experiments]
    assert on_cpu.result.predictions == []


def test_a_latency_search_is_never_gated(tmp_path):
    # the same runs, mbs 16 then 32, then mbs 24: tuning throughput (perfect scaling, 10 samples/s per unit of mbs)
    # the throughput model skips mbs 24; tuning latency (0.1 s a step at every mbs) it is launched
    def runs(metric, value):
        launched = []

        def evaluate(exps):
            for exp in exps:
                launched.append(exp.name)
                exp.status, exp.metric, exp.metric_rel_half_width = Status.OK, value(exp.mbs), 0.01
            return exps
        strategy = Strategy(make_job(tmp_path / metric, metric), evaluate)
        for mbs in (16, 32, 24):
            strategy.evaluate([strategy.builder.mbs_experiment(0, mbs)])
        return launched, [(e.name, e.status.value) for e in strategy.result.experiments], strategy.result.predictions

    launched, ledger, predictions = runs("throughput", lambda mbs: 10.0 * mbs)
    assert launched == ["z0_gas1_tmbspg16", "z0_gas1_tmbspg32"]
    assert ledger[-1] == ("z0_gas1_tmbspg24", "skipped") and [p.name for p in predictions] == ["z0_gas1_tmbspg24"]
    launched, ledger, predictions = runs("latency", lambda mbs: 0.1)
    assert launched == ["z0_gas1_tmbspg16", "z0_gas1_tmbspg32", "z0_gas1_tmbspg24"]
    assert ledger[-1] == ("z0_gas1_tmbspg24", "ok") and predictions == []
