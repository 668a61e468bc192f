"""Tests of zerotune.strategy.tuners: order, reproducibility, budgets, early stopping, failures, model-based."""
from __future__ import annotations

import pytest

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Status
from zerotune.inputs.space import default_space, generate
from zerotune.strategy.tuners import GridSearchTuner, RandomTuner, make_tuner

Z = "zero_optimization."


def mbs_space(fits_max: int | None = None):
    """Eight candidates z0_gas1_tmbspg1 .. z0_gas1_tmbspg128 (powers of two); above fits_max they
    do not fit."""
    fits = None if fits_max is None else (lambda cfg: cfg["train_micro_batch_size_per_gpu"] <= fits_max)
    return generate({}, {"train_micro_batch_size_per_gpu": [1, 2, 4, 8, 16, 32, 64, 128]},
                    stage=0, dp_world_size=1, fits=fits)


def z2_space():
    return generate({"train_micro_batch_size_per_gpu": 4}, default_space(2), stage=2, dp_world_size=1)


def drain(tuner, metric_of, n=1):
    """Run a tuner to the end, n experiments at a time; returns the names in proposal order."""
    order = []
    while not tuner.finished:
        batch = tuner.ask(n)
        assert batch, "ask returned nothing while nothing is outstanding"
        for c in batch:
            order.append(c.name)
            value = metric_of(c)
            if value is None:
                tuner.tell(c.name, Status.OOM)
            else:
                tuner.tell(c.name, Status.OK, value)
    return order


def mbs(c):
    return c.ds_config["train_micro_batch_size_per_gpu"]


# ---- grid and random ---------------------------------------------------------------------------


def test_grid_order_is_generate_order_and_skips_unfit():
    space = mbs_space(fits_max=16)
    tuner = GridSearchTuner(space)
    assert [c.name for c in tuner.ask(3)] == ["z0_gas1_tmbspg1", "z0_gas1_tmbspg2", "z0_gas1_tmbspg4"]
    assert [c.name for c in tuner.ask(10)] == ["z0_gas1_tmbspg8", "z0_gas1_tmbspg16"]  # never the unfit ones
    assert tuner.ask(1) == [] and tuner.finished


def test_grid_order_z2_exact():
    tuner = make_tuner("gridsearch", z2_space())
    # dimensions sorted by key: allgather_bucket_size (slowest), contiguous_gradients,
    # overlap_comm, reduce_bucket_size, reduce_scatter (fastest)
    assert [c.name for c in tuner.ask(4)] == [
        "z2_gas1_tmbspg4_oc1_rbs5e7_agbs5e7",
        "z2_gas1_tmbspg4_oc1_rs0_rbs5e7_agbs5e7",
        "z2_gas1_tmbspg4_oc1_agbs5e7",
        "z2_gas1_tmbspg4_oc1_rs0_agbs5e7",
    ]


def test_random_seeded_reproducible_without_repeats():
    space = z2_space()
    a = drain(RandomTuner(space, seed=7), lambda c: 1.0, n=5)
    b = drain(make_tuner("random", space, seed=7), lambda c: 1.0, n=3)
    c = drain(RandomTuner(space, seed=8), lambda c: 1.0)
    assert a == b
    assert a != c
    assert len(a) == len(set(a)) == 72 and sorted(a) == sorted(x.name for x in space)
    assert a[:3] != [x.name for x in space[:3]]


def test_num_trials_counts_proposals():
    tuner = GridSearchTuner(z2_space(), num_trials=5)
    first = tuner.ask(3)
    second = tuner.ask(3)
    assert len(first) == 3 and len(second) == 2
    assert tuner.finished and tuner.ask(1) == []
    for c in first + second:
        tuner.tell(c.name, Status.OK, 1.0)
    assert len(tuner.history) == 5


# ---- outcomes ----------------------------------------------------------------------------------


def test_failures_are_not_scored_and_not_reproposed():
    tuner = GridSearchTuner(mbs_space(), objective="latency")  # minimised: a 0 would win
    batch = tuner.ask(4)
    tuner.tell(batch[0].name, Status.OOM, 0.0)
    tuner.tell(batch[1].name, Status.FAILED)
    tuner.tell(batch[2].name, Status.OK, 0.5)
    tuner.tell(batch[3].name, Status.TIMEOUT, None)
    best, value = tuner.best
    assert (best.name, value) == ("z0_gas1_tmbspg4", 0.5)
    assert tuner.history == [("z0_gas1_tmbspg1", Status.OOM, None), ("z0_gas1_tmbspg2", Status.FAILED, None),
                             ("z0_gas1_tmbspg4", Status.OK, 0.5), ("z0_gas1_tmbspg8", Status.TIMEOUT, None)]
    rest = [c.name for c in tuner.ask(10)]
    assert rest == ["z0_gas1_tmbspg16", "z0_gas1_tmbspg32", "z0_gas1_tmbspg64", "z0_gas1_tmbspg128"]


def test_no_success_means_no_best():
    tuner = GridSearchTuner(mbs_space())
    for c in tuner.ask(8):
        tuner.tell(c.name, Status.OOM)
    assert tuner.best is None and tuner.finished


def test_interrupted_is_proposed_again():
    tuner = GridSearchTuner(mbs_space(), num_trials=2)
    a, b = tuner.ask(2)
    tuner.tell(a.name, Status.INTERRUPTED)
    assert not tuner.finished
    assert [c.name for c in tuner.ask(5)] == ["z0_gas1_tmbspg1"]
    tuner.tell(b.name, "ok", 3.0)
    tuner.tell(a.name, "ok", 2.0)
    assert tuner.finished and tuner.best[0].name == "z0_gas1_tmbspg2"


def test_tell_errors_and_resume():
    tuner = GridSearchTuner(mbs_space(), num_trials=3)
    with pytest.raises(ValueError, match="not a candidate"):
        tuner.tell("z9_nope", Status.OK, 1.0)
    c, = tuner.ask(1)
    with pytest.raises(ValueError, match="expected a finite metric"):
        tuner.tell(c.name, Status.OK, None)
    tuner.tell(c.name, Status.OK, 1.0)
    with pytest.raises(ValueError, match="already told"):
        tuner.tell(c.name, Status.OK, 1.0)
    # a result from an earlier run (resume): counts as proposed, never proposed again
    tuner.tell("z0_gas1_tmbspg4", Status.OK, 5.0)
    assert tuner.best[0].name == "z0_gas1_tmbspg4"
    assert [x.name for x in tuner.ask(5)] == ["z0_gas1_tmbspg2"]
    assert tuner.finished


def test_bad_arguments():
    with pytest.raises(ConfigError, match="autotuning.tuner_type = 'bayes': expected one of "
                                          "gridsearch, random, model_based"):
        make_tuner("bayes", mbs_space())
    with pytest.raises(ConfigError, match="metric = 'speed'"):
        GridSearchTuner(mbs_space(), objective="speed")
    with pytest.raises(ConfigError, match="early_stopping = 0"):
        GridSearchTuner(mbs_space(), early_stopping=0)


# ---- early stopping ----------------------------------------------------------------------------

# A known throughput curve over the micro batch size: rises to mbs 8, then falls.
CURVE = {1: 10.0, 2: 19.0, 4: 30.0, 8: 33.0, 16: 32.0, 32: 31.0, 64: 20.0, 128: 5.0}


def test_early_stopping_sequential_exact_trace():
    tuner = GridSearchTuner(mbs_space(), early_stopping=2)
    order = drain(tuner, lambda c: CURVE[mbs(c)])
    # best at mbs 8; 16 and 32 do not improve -> stop after 2 reports without improvement
    assert order == [f"z0_gas1_tmbspg{m}" for m in (1, 2, 4, 8, 16, 32)]
    assert tuner.best[0].name == "z0_gas1_tmbspg8"


def test_early_stopping_not_before_first_success():
    tuner = GridSearchTuner(mbs_space(), early_stopping=2)
    order = drain(tuner, lambda c: None if mbs(c) <= 4 else CURVE[mbs(c)])
    # 3 OOMs do not stop it (no best yet); then 8 is best, 16 and 32 do not improve
    assert order == [f"z0_gas1_tmbspg{m}" for m in (1, 2, 4, 8, 16, 32)]


def test_early_stopping_with_batches_and_out_of_order_reports():
    tuner = GridSearchTuner(mbs_space(), early_stopping=3)
    a, b = tuner.ask(2)  # mbs1, mbs2; no best yet: no limit
    tuner.tell(b.name, Status.OK, 19.0)  # first success: since_best = 0
    # 1 outstanding, patience 3 -> at most 3 - 0 - 1 = 2 more
    c, d = tuner.ask(4)
    assert [c.name, d.name] == ["z0_gas1_tmbspg4", "z0_gas1_tmbspg8"]
    tuner.tell(a.name, Status.OK, 10.0)  # no improvement: since_best = 1
    assert tuner.ask(4) == [] and not tuner.finished  # 3 - 1 - 2 outstanding = 0
    tuner.tell(d.name, Status.OK, 33.0)  # improvement (out of order): since_best = 0
    e, f = tuner.ask(4)  # 3 - 0 - 1 outstanding = 2
    assert [e.name, f.name] == ["z0_gas1_tmbspg16", "z0_gas1_tmbspg32"]
    tuner.tell(c.name, Status.OK, 30.0)  # 1
    tuner.tell(f.name, Status.OOM)  # 2: a failure does not improve
    assert not tuner.finished and tuner.ask(4) == []  # 3 - 2 - 1 outstanding = 0
    tuner.tell(e.name, Status.OK, 32.0)  # 3 -> stop for good
    assert tuner.finished and tuner.ask(4) == []
    assert tuner.best[0].name == "z0_gas1_tmbspg8"
    assert [h[0] for h in tuner.history] == [f"z0_gas1_tmbspg{m}" for m in (2, 1, 8, 4, 32, 16)]


# ---- model-based ----------------------------------------------------------------------------------


def z2_throughput(c):
    """Synthetic throughput over the 72-config z2 space: best at oc1 rs1 cg1 rbs5e8 agbs5e8;
    rbs 1e9 with overlap_comm is OOM."""
    k = {Z + key: value for key, value in c.ds_config["zero_optimization"].items()}
    if k[Z + "overlap_comm"] and k[Z + "reduce_bucket_size"] == 1e9:
        return None
    value = 100.0
    value *= 1.20 if k[Z + "overlap_comm"] else 1.0
    value *= 1.10 if k[Z + "reduce_scatter"] else 1.0
    value *= 1.05 if k[Z + "contiguous_gradients"] else 1.0
    value *= {5e7: 0.85, 5e8: 1.0, 1e9: 0.95}[k[Z + "reduce_bucket_size"]]
    value *= {5e7: 0.90, 5e8: 1.0, 1e9: 0.97}[k[Z + "allgather_bucket_size"]]
    return value


def test_model_based_converges_on_synthetic_function():
    space = z2_space()
    optimum = max(space, key=lambda c: z2_throughput(c) or 0.0)
    assert optimum.name == "z2_gas1_tmbspg4_oc1"
    found_at = []
    for seed in range(3):
        tuner = make_tuner("model_based", space, seed=seed)
        order = []
        while optimum.name not in order:
            c, = tuner.ask(1)
            order.append(c.name)
            value = z2_throughput(c)
            tuner.tell(c.name, Status.OOM if value is None else Status.OK, value)
        assert tuner.best[0].name == optimum.name
        found_at.append(len(order))
    assert found_at == [5, 11, 17]  # of 72; grid order needs 27 (GP; over seeds 0-19 it averages 13.1, TPE 14.8)
    grid = [c.name for c in space]
    assert grid.index(optimum.name) + 1 == 27


def small_z2_space():
    """18 configs: z2_space with overlap_comm and contiguous_gradients fixed on."""
    space = default_space(2)
    space["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True)
    return generate({"train_micro_batch_size_per_gpu": 4}, space, stage=2, dp_world_size=1)


def test_model_based_reproducible_distinct_and_exhaustive_in_batches():
    space = small_z2_space()
    assert len(space) == 18
    a = drain(make_tuner("model_based", space, seed=3, n_startup_trials=2), z2_throughput, n=4)
    b = drain(make_tuner("model_based", space, seed=3, n_startup_trials=2), z2_throughput, n=4)
    assert a == b
    assert len(a) == len(set(a)) == 18  # every ask yields new experiments until exhausted


def test_model_based_tells_optuna_real_outcomes():
    from optuna.trial import TrialState

    space = z2_space()
    tuner = make_tuner("model_based", space, seed=0, n_startup_trials=2)
    oom = next(c for c in space if z2_throughput(c) is None)
    tuner.tell(oom.name, Status.OOM)  # resumed result
    for _ in range(6):
        c, = tuner.ask(1)
        value = z2_throughput(c)
        tuner.tell(c.name, Status.OK if value is not None else Status.OOM, value)
    told = [t for t in tuner._study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(told) == 7
    for t in told:
        infeasible = t.constraints["zerotune_infeasible"] > 0
        assert infeasible == (t.state is TrialState.PRUNED)
        assert (t.value is None) == infeasible  # an OOM has no value: never 0
    assert all(t.state is TrialState.FAIL for t in tuner._study.trials if t not in told)
    assert oom.name not in [h[0] for h in tuner.history[1:]]


def test_model_based_never_proposes_unfit():
    space = generate({}, {"train_micro_batch_size_per_gpu": [1, 2, 4, 8, 16, 32, 64, 128]},
                     stage=0, dp_world_size=1, fits=lambda cfg: cfg["train_micro_batch_size_per_gpu"] != 8)
    order = drain(make_tuner("model_based", space, seed=0), lambda c: float(mbs(c)), n=3)
    assert sorted(order) == sorted(c.name for c in space if c.name != "z0_gas1_tmbspg8")


def test_model_based_tpe_sampler_and_unknown_sampler():
    space = z2_space()
    order = drain(make_tuner("model_based", small_z2_space(), seed=0, sampler="tpe"), z2_throughput, n=4)
    assert len(order) == len(set(order)) == 18
    with pytest.raises(ConfigError, match="sampler = 'bo': expected 'gp' or 'tpe'"):
        make_tuner("model_based", space, sampler="bo")
