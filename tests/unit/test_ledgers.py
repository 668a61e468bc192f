"""The whole tuner on the SIMULATED cluster (benchmarks/simcluster), pinned to its exact ledger.

Each case runs ``Autotuner`` end to end on a :class:`SimulatedBackend` (no process, milliseconds)
and pins every launch in order, its outcome, each ZeRO stage's decision and stop reason, and the
answer. Launches are pinned by what they ran (ZeRO stage, mbs, gas, status, and the knob
settings of the knob phase), not by name, so that a renaming leaves the pins valid. Since issue 10
the SIMULATED runs draw fresh noise on every run (1%, seeded by scenario, config and run count),
and zerotune decides on the step probe's streams the simulator writes: the pins hold one seeded
draw, and any change to what is run or how it is measured shows up here. The pins are data
(``tests/data/ledger_pins.json``); ``tests/regen_ledger_pins.py`` regenerates them (``--write``) and lists the
cases that moved; the history below says why each move happened.
"""
import pytest

from tests.helpers import ledger_pins
from tests.helpers.ledger_pins import plain
from tests.helpers.simulated import tune_simulated

# Regenerated (issue 10): throughput searches start at the memory model's estimate and go down only while
# halving clearly pays (zerotune.strategy.mbs, top-down); a higher stage with more memory headroom is probed at
# its own largest mbs (zerotune.strategy.stages); noise tests count the run-to-run noise; gas doubles once at
# the best mbs where the global batch is free (zerotune.inputs.batch); the warm-up is cut by MSER (core.measure).
# Then (cost): at most 2 configs are re-measured before the answer (FINAL_CANDIDATES, was 3), and only when one
# of them is not known to the target precision; ZeRO-3 without more headroom is skipped once stage 1 or 2 did
# not beat the best at that mbs (strategy.stages); the fine pass skips the gap below the best when the best and
# the point below it are both known to the precision and tie (a plateau, strategy.mbs).
# Then (issue 12, memory fidelity): every stage's reduction flattens its gradient bucket (b*min(R, T) at
# stages 1-3), stage 3 holds a coalesced all-gather's flat buffer (b*min(G, max(L, F))), and the profile run's
# first forward holds L + persistent gathered parameters, not G (zerotune.model.memory): the estimates move,
# and with them the largest mbs each stage starts from.
# Then (issue 12, session 6): the reduction's flat copy made after the backward pass (stage 0, stage 1 without
# overlap_comm, a bucket that holds every parameter) shares its room with the freed activations, and fp32 ZeRO-3
# keeps a master copy: stages 0-1 start one or two mbs higher. The simulator's own memory (benchmarks/simcluster)
# still adds activations and buffers, so near the boundary these start on an OOM or under its memory pressure:
# scenario 0 ends on ZeRO-2 mbs 29 at gas 2 (was ZeRO-0 mbs 28), scenario 21 on ZeRO-1 mbs 27 at gas 2 (was ZeRO-3
# mbs 44).
# Then (session 7): a config the memory model, corrected online by the runs so far, puts over the budget is not
# launched (zerotune.strategy.tuning, Strategy.evaluate): the same answers and stage decisions, 18 launches fewer
# (17 OOMs, and scenario 21's ZeRO-1 at mbs 30, which had fit).
# Then (session 8): a stage probe that loses within the noise re-measures the best point it lost to, not only the
# best stage's point at the probe's mbs (zerotune.strategy.stages): scenario 0 runs one replica more.
# Then (session 8): the gas phase first runs the best mbs's global batch split in two (half the mbs at twice the
# gas) where a measured mbs from that half up ties the best (zerotune.strategy.tuning, Strategy.tune_gas):
# scenarios 0 and 33 run it (it loses on the simulator, whose throughput only rises with mbs); the same answers.
# Then (session 9): with "fast": false the answer is re-measured while it has one run (Strategy.measure_answer_twice):
# scenario 11 (stages 1-2) runs its answer once more; in scenario 16 the answer's second run drops it below another
# ZeRO-3 knob setting, which is re-measured in turn and stays the answer.
# Then (session 10): a gas-ladder rung is not run where the probe's once-per-step share (boundary_s: optimizer
# step, boundary reduction) bounds its gain under the 1% plateau threshold (zerotune.inputs.batch,
# doubling_gain_bound): the ZeRO-2/3 answers of scenarios 0, 11, 16 and 33 and the gas-doubling batch case run no
# rung. The answers keep their stage and mbs; scenario 0's, 16's and 11's (stages 1-2, "fast": false) were at gas 2,
# now gas 1. With "fast": false scenario 16's knob phase runs 9 launches fewer and scenario 11's (stages 1-2) 3 more.
# The split (half the mbs at twice the gas) likewise, bounded from the mbs search's point at or above half
# (Strategy.split_cannot_pay): scenarios 0 and 33 no longer run it (it lost there).
# Then (session 10): a higher stage's probe at its own largest fitting mbs that loses is probed again at the best's
# mbs (its largest mbs sits at its memory boundary, where the simulator's allocator pressure slows it;
# zerotune.strategy.stages): scenario 21 now explores ZeRO-3 from that second probe and answers ZeRO-3 mbs 27 (was
# ZeRO-1 mbs 27 at gas 2); scenarios 0 and 16 and the fixed-train_batch_size case run the second probe and keep
# their answers.
# Then (session 10): a best at the memory boundary (the next mbs failed) that ties the point below it precisely is
# no plateau (zerotune.strategy.mbs, the fine pass): the gap below is bisected; scenario 11 (and its gas-doubling
# batch case) runs 2 launches more, with stages 1-2 1 more; the same answers.
# Then (session 11): the run-to-run noise is estimated from the configs run more than once (core.measure.run_noise)
# and every noise test uses it: no pin moves (their replicas spread under 1%, so the estimate stays at its 1%
# floor). An equal-mbs stage probe that wins within the noise is re-measured with the best before its stage is
# searched (strategy.stages): the mbs-and-gas-lists batch case re-measures ZeRO-2 and ZeRO-1 at mbs 6 (2 launches
# more), ZeRO-2 still wins pooled and is searched; the same answer.
# Then (session 12): with "fast": true the answer is re-measured where its one run reads above the line through its
# mbs neighbours by more than the noise (Strategy.answer_stands_out): scenario 0's ZeRO-2 mbs 29 (between mbs 28 and
# 30) runs once more and stays the answer.
# Then (session 13): a throughput search looks below its best only where the best ran near the device's capacity
# (its measured peak at least 0.9 of the budget, zerotune.strategy.mbs.NEAR_CAPACITY), and there at the largest mbs
# the memory model puts under 0.9 of it, not at half the best: scenarios 11 and 16 and the gas-doubling batch case
# run 5-7 launches fewer, the mbs-and-gas-lists case 4 fewer, 0, 21 and 33 2 fewer; with "fast": false, 16 runs 5
# fewer and 11 (stages 1-2) 1. The same answers but scenario 0's: ZeRO-2 mbs 28 (was 29; noise-free 414.4 against
# 412.5 samples/s).
# Then (session 13): the fine pass runs once, last, on the best stage only (zerotune.strategy.stages): scenario 0
# runs 3 launches fewer, 21 6 fewer and answers ZeRO-3 mbs 41 (was 27; noise-free 0.999 of the optimum, was
# 0.992), 11 and its gas-doubling batch case 3 more (without ZeRO-1's fine pass ZeRO-1's best is 6, so ZeRO-2's
# probe retry lands at 7 and ties within the noise, re-measured; ZeRO-3's 8 and 7 are re-measured before the
# answer); the other answers stay.
# Then (session 14): the fine pass bisects the gap above the best only where the step-time line through the best and
# the nearest calm point below predicts a gain over the threshold and beyond the two runs' noise, and the gap below
# only from a best near capacity (zerotune.strategy.mbs._above_may_pay, _below_may_pay): scenario 21 no longer runs
# ZeRO-3 mbs 44 and 42 (and re-measures its answer, 41, instead), 33 no
# longer runs mbs 16; the same answers.
# Then (session 15): the profile's activations count the layer that activation checkpointing recomputes in the
# backward pass (zerotune's probe runs each checkpointed region once more; the simulator writes the probe's record,
# and writes both records at the profile run's own mbs, where DeepSpeed's figure had been one sample's whatever the
# mbs): scenarios 21 and 33 (checkpointed) start at smaller estimates that still run out of memory (the simulator
# adds a CUDA context and fragmentation that no profile peak calibrates there); 21 answers ZeRO-3 mbs 42 (was 41)
# in 3 launches more, 33 keeps mbs 15. The mbs-and-gas-lists case (profile at mbs 2) no longer launches ZeRO-0 at
# mbs 6, which its activations, no longer halved, put over the budget.
# Then (session 16): where the first stage to run runs out of memory at its estimate and a later stage's estimate is
# larger, it is deferred (zerotune.strategy.stages): the later stage goes first, and the deferred one comes back as a
# probe capped below its OOM. Scenario 16 no longer searches ZeRO-1 (3 launches) and probes it at 4 once ZeRO-3 has
# won, in 4 launches fewer (with "fast": false, 4 fewer too); the same answer, ZeRO-3 mbs 5. Scenario 21 starts
# ZeRO-3 at its uncorrected estimate, 52, which runs out of memory; halving to 26 and bisecting, 39 reads within 1%:
# a plateau, and it answers ZeRO-3 mbs 26 (was 42; noise-free 0.991 of the optimum, was 1.000) in 2 launches fewer.
# Then (session 17): on GPU ranks a config's runs away from the device's capacity (measured peaks under 0.9 of the
# budget) count as one curve rising with mbs, fitted by pooling adjacent readings that fall, worth the fit at its
# largest mbs (zerotune.report.results.rising_answer): the same ledgers; scenario 21 answers ZeRO-3 mbs 39 (was 26;
# noise-free 0.999 of the optimum, was 0.991), 33 ZeRO-3 mbs 17 (was 15; 1.000, was 0.996). The fine pass bisects
# next to that answer (zerotune.strategy.mbs.MbsTrace.answer): scenario 21 no longer bisects between ZeRO-3 mbs 26
# and 39 (32, 29, 27: 3 launches fewer), the same answer.
# Then (issue 29): a candidate the throughput model bounds under the best plus the precision is not launched
# (zerotune.strategy.prediction), a difference within the precision is a tie that is never re-measured, and an
# OOM or a peak above the estimate raises every stage with no run of its own (zerotune.model.online): 14 -> 10
# launches in scenario 0 (it answers ZeRO-3 mbs 26, noise-free 0.989 of the optimum, was ZeRO-2 mbs 28, 1.000),
# 15 -> 10 in 11, 9 -> 7 in 21, 27 -> 26 in 11 with stages 1-2; the batch cases 9 -> 7, 15 -> 10 and 8 -> 6 (the
# lists case answers gas 1, was gas 2: a tie within the precision).
# Then (issue 39): the memory model is a line per stage and saver fitted through every measured peak, the profile's
# prior as one point and an OOM a lower bound, with an explicit margin (zerotune.model.online, docs/decisions.md
# D110), no longer a one-way raise shared by every stage; a config it refuses is Status.REFUSED, shown with its
# prediction. Scenario 0's ZeRO-3 second probe is at 27, the largest mbs the fit puts under 90% of the budget (26
# before): it loses, and the answer is ZeRO-2 mbs 27 (noise-free 0.999 of the optimum; was ZeRO-3 mbs 26, 0.989).
# Scenario 11 launches ZeRO-0 at 5 and ZeRO-1 and 2 at their planned 9, all out of memory (12 -> 15 launches; the
# raise refused them): its prior, uncalibrated on the SIMULATED cluster (the profile run reports no peak), lies
# 2.3 GiB above ZeRO-0's line at mbs 1, so the line through it and mbs 4 is 2.87 GiB/sample against 3.65; the same
# answer. With stages 1-2 it no longer runs ZeRO-1 at 8 (38.85 GiB, it fits: the fit puts it at 39.38 GiB, 40.35
# with its 3.1% margin), and the knob phase runs the 1e9-element reduce bucket the raise had put over the budget in
# place of two configs without contiguous gradients: 27 -> 26, the same answer. Scenario 16 probes ZeRO-3 with
# offload at 6, the fit's largest mbs for it (the raise's was 5): one more launch, the same answer, with stages 0-3
# and with "fast": false. Scenario 21 no longer launches ZeRO-2 at 44 (out of memory): 7 -> 6. The gas-doubling
# batch case (scenario 11): 12 -> 15, as scenario 11.
# Then (issue 41): configs within the target precision (2%) of the best reading tie, and the tie order takes one
# without a launch (more memory headroom, then the lower ZeRO stage, then the smaller global batch:
# zerotune.strategy.answer); a replica runs only where the run-to-run noise, not the runs' own intervals, blocks a
# decision (zerotune.core.noise.replica_decides). Scenario 11 answers ZeRO-3 mbs 7 (was 8, its replica gone:
# 15 -> 14), as does its gas-doubling batch case; with stages 1-2 and "fast": false, ZeRO-1 mbs 7 (was ZeRO-2 mbs 8
# with knobs), and scenario 16 with "fast": false keeps ZeRO-3 mbs 5 with the knob setting that ties it with more
# headroom, re-measured in place of the plain config.
# Then (D313): the tie order takes more memory headroom only where a tied config runs near the device's capacity
# (a peak at least 0.9 of the budget), else the better reading (the lower stage and the smaller global batch no
# longer decide). Scenario 11 with stages 1-2 and "fast": false answers ZeRO-2 mbs 8 with knobs again (ZeRO-1 mbs 7
# under the old order); scenario 16 with "fast": false keeps ZeRO-3 mbs 5, the plain config. Each re-measures its
# answer; the launches are unchanged.
# Then (issue 52, D322): a candidate is launched only where what it could gain at most is more than one run of it and
# the best can read apart by noise alone (zerotune.core.noise.resolvable). Scenario 11 no longer runs ZeRO-2 at 6
# (at most +2.1% over ZeRO-1's 55.59 at mbs 6, against a noise of ±3.3%), so ZeRO-2 is probed, not explored, and
# its mbs 8 is not run either: 14 -> 12 launches, as its gas-doubling batch case; the same answer.
# Then (issue 54, D338): a multi-node ZeRO-3 best is probed once with hpZ over a node's 8 GPUs: scenarios 16 and 21
# buy that one launch (7 -> 8, 6 -> 7) and keep their answers; in scenario 33 the memory model does not fit it at the
# best mbs (not launched). Scenario 16 with "fast": false samples its knobs from the stage-3 space with ZeRO++'s
# quantized weights and gradients: as many launches, and the answer quantizes the weights (the simulator halves its
# forward all-gathers).
PINS, BATCH_PINS = ledger_pins.load()  # tests/data/ledger_pins.json, written by tests/regen_ledger_pins.py


@pytest.mark.parametrize("case", list(PINS), ids=lambda c: f"scenario{c[0]}-fast{c[1]}-stages{c[2]}")
def test_simulated_ledger_is_pinned(tmp_path, case):
    ledger, decisions, answer = tune_simulated(tmp_path, *case)
    pin = PINS[case]
    assert plain(ledger) == pin["ledger"]
    assert plain(decisions) == pin["decisions"]
    assert plain(answer) == pin["answer"]


# Batch semantics (issue 10): the same SIMULATED scenario under each rule of zerotune.inputs.batch


@pytest.mark.parametrize("name", list(BATCH_PINS))
def test_simulated_ledger_under_batch_semantics_is_pinned(tmp_path, name):
    pin = BATCH_PINS[name]
    ledger, decisions, answer = tune_simulated(tmp_path, pin["scenario"], True, "all", pin["overrides"])
    assert plain(ledger) == pin["ledger"]
    assert plain(decisions) == pin["decisions"]
    assert plain(answer) == pin["answer"]


@pytest.mark.parametrize("case", [(0, True, "all"), (16, False, "all")], ids=["scenario0-fast", "scenario16-knobs"])
def test_a_simulated_rerun_launches_nothing_and_gives_the_same_answer(tmp_path, case):
    """Resume: every decision reads only what exp.json keeps, so a rerun in the same results dir takes
    every outcome from disk (the real-run twin is tests/e2e/test_e2e.py, where CI once saw 3 relaunches)."""
    first, decisions, answer = tune_simulated(tmp_path, *case)
    again, again_decisions, again_answer = tune_simulated(tmp_path, *case)
    assert first and again == []
    assert (again_decisions, again_answer) == (decisions, answer)
