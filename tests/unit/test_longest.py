"""The answer at the longest batch (issue 42): memory per token, the longest batch's source, a config that fits only
the seen batches giving way to the next, and the verification run at the longest length."""
import dataclasses
import types

import pytest

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import OBJECTIVES, Objective
from zerotune.core.stopping import StopRule
from zerotune.inputs.options import LongestOptions
from zerotune.model.memory import MemoryModel
from zerotune.model.online import OnlineMemory
from zerotune.model.tokens import LongestBatch, check_longest, longest_batch, square_bytes, token_slope
from zerotune.run.backends.watch import StreamWatch
from zerotune.strategy.ledger import Ledger
from zerotune.strategy.longest import settle_longest

MEMORY = OnlineMemory(MemoryModel(1_000_000, 400_000, 2, overhead_bytes=50_000_000))
PER_TOKEN, FIXED = 1000, 100_000_000  # bytes per token per sample, and what a run holds whatever its batch


def run(mbs, seen, metric, shortest=64, status=Status.OK, square=0):
    """A ZeRO-0 run whose peak is its structural terms, FIXED, PER_TOKEN for each token of its longest batch and
    ``square`` bytes per token squared per sample."""
    cfg = {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": 0}}
    peak = MEMORY.structural_bytes(cfg, mbs) + FIXED + PER_TOKEN * mbs * seen + square * mbs * seen ** 2
    return Experiment(f"z0_gas1_tmbspg{mbs}", cfg, num_slots=2, status=status, metric=metric, peak_memory_bytes=peak,
                      max_seq_len_seen=seen, min_seq_len_seen=shortest)


def test_the_longest_batch_comes_from_the_option_then_the_model_then_the_runs():
    runs = [run(4, 128, 100.0), run(8, 96, 110.0)]
    assert longest_batch(2048, 1024, runs) == LongestBatch(2048, "--max-seq-len", 128)
    assert longest_batch(None, 1024, runs).seq_len == 1024 and "n_positions" in longest_batch(None, 1024, runs).source
    guess = longest_batch(None, None, runs)
    assert (guess.seq_len, guess.fixed) == (128, False) and "a guess" in guess.source
    fixed = [run(4, 128, 100.0, shortest=128), run(8, 128, 110.0, shortest=128)]  # every batch 128 tokens
    assert longest_batch(None, 1024, fixed) == LongestBatch(
        128, "every batch held 128 tokens (a fixed-shape workload)", 128, fixed=True)
    images = [Experiment("z0", {"train_micro_batch_size_per_gpu": 4}, status=Status.OK)]  # no token ids
    assert longest_batch(None, 1024, images) is None and longest_batch(512, None, images).seen is None


def test_bytes_per_token_are_fitted_where_the_runs_saw_two_lengths_and_scaled_from_the_slope_where_one():
    runs = [run(4, 128, 100.0), run(8, 96, 110.0)]  # tokens 512 and 768 at two lengths: the fit is exact
    assert token_slope(MEMORY, runs, runs[1].ds_config) == pytest.approx(PER_TOKEN)
    one_length = [run(4, 128, 100.0)]  # the family's bytes per sample (the prior's line here) over 128 tokens
    assert token_slope(MEMORY, one_length, one_length[0].ds_config) == MEMORY.line(runs[0].ds_config).slope / 128
    assert token_slope(MEMORY, [], runs[0].ds_config) is None


def test_the_peak_at_the_longest_batch_adds_the_tokens_it_holds_beyond_the_seen():
    runs = [run(4, 128, 100.0), run(8, 96, 110.0)]
    budget = runs[1].peak_memory_bytes + 6_500_000
    check = check_longest(runs[1], MEMORY, runs, LongestBatch(1024, "--max-seq-len", 128), budget)
    # 8 samples x (1024 - 96) more tokens x 1000 bytes = 7,424,000 over its measured peak: over the budget
    assert (check.predicted_bytes - runs[1].peak_memory_bytes, check.fits, check.margin_bytes) == (
        7_424_000, False, -924_000)
    # mbs 4: 4 x 896 x 1000 = 3,584,000 over a peak 1,344,000 above mbs 8's (structural terms 1,600,000 more, tokens
    # 256,000 fewer): 6,500,000 - 1,344,000 - 3,584,000 = 1,572,000 left
    small = check_longest(runs[0], MEMORY, runs, LongestBatch(1024, "--max-seq-len", 128), budget)
    assert (small.predicted_bytes - runs[0].peak_memory_bytes, small.margin_bytes) == (3_584_000, 1_572_000)


def test_attention_scores_add_the_square_of_the_longest_length_and_leave_the_per_token_fit_exact():
    runs = [run(4, 128, 100.0, square=2), run(8, 96, 110.0, square=2)]
    assert token_slope(MEMORY, runs, runs[1].ds_config, square=2.0) == pytest.approx(PER_TOKEN)
    check = check_longest(runs[1], MEMORY, runs, LongestBatch(1024, "--max-seq-len", 128), 10**10, square=2.0)
    # 8 x 928 x 1000 = 7,424,000 for the tokens, 2 x 8 x (1024^2 - 96^2) = 16,629,760 for the scores
    assert check.predicted_bytes - runs[1].peak_memory_bytes == 7_424_000 + 16_629_760
    assert "and attention scores of 2.0 bytes per token squared per sample)" in check.describe()
    assert square_bytes({"square_seq_len": 31, "square_saved_bytes": 138_384, "micro_batch_size": 3}) == 48.0
    assert square_bytes(None) == 0.0


def evaluator(runs, budget, launched=()):
    """The strategy's evaluator as settle_longest sees it: the ledger, the fitted memory, the budget; a launch
    outside the ledger returns the next of ``launched`` as that run's outcome."""
    ledger = Ledger(Objective.named("throughput"))
    for e in runs:
        ledger.add(e)
    outcomes = iter(launched)

    def launch(batch):
        (exp,) = batch
        exp.status = next(outcomes)
        exp.peak_memory_bytes = 200 * 2 ** 20 if exp.status is Status.OK else None
        return [exp]

    builder = types.SimpleNamespace(experiment=lambda cfg, kind, knobs: Experiment("x", cfg, num_slots=2, kind=kind))
    return types.SimpleNamespace(ledger=ledger, job=types.SimpleNamespace(device_memory_bytes=budget),
                                 result=types.SimpleNamespace(memory=MEMORY), builder=builder,
                                 launch_outside_ledger=launch)


def test_a_config_that_fits_only_the_seen_batches_is_not_the_answer_the_next_one_is():
    runs = [run(4, 128, 100.0), run(8, 96, 110.0)]
    ev = evaluator(runs, runs[1].peak_memory_bytes + 6_500_000)
    assert ev.ledger.answer.name == "z0_gas1_tmbspg8"  # the faster: on the seen batches it fits
    found = settle_longest(ev, LongestOptions(max_seq_len=1024), None)
    assert ev.ledger.answer.name == "z0_gas1_tmbspg4" and list(ev.ledger.excluded) == ["z0_gas1_tmbspg8"]
    assert [(c.name, c.fits) for c in found.checks] == [("z0_gas1_tmbspg8", False), ("z0_gas1_tmbspg4", True)]
    notes = found.notes()
    assert notes[0] == "longest batch: 1024 tokens (--max-seq-len; the runs saw at most 128)"
    assert notes[1].endswith("margin -902.34 KiB (-1%): not the answer: over the budget at the longest batch")
    assert notes[2] == ("longest batch: z0_gas1_tmbspg4: measured peak 113.40 MiB at 128 tokens; at 1024 tokens "
                        "116.82 MiB predicted (4 sample(s) x 896 more tokens x 1000 B per token per sample); budget "
                        "118.32 MiB, margin 1.50 MiB (1%): the answer")


def test_an_answer_over_the_budget_with_no_other_config_left_stands_and_says_so():
    only = [run(8, 96, 110.0)]
    ev = evaluator(only, only[0].peak_memory_bytes + 6_500_000)
    found = settle_longest(ev, LongestOptions(max_seq_len=1024), None)
    assert ev.ledger.answer.name == "z0_gas1_tmbspg8" and not ev.ledger.excluded
    assert [c.fits for c in found.checks] == [False]  # one length: the fitted bytes per sample over 96 tokens
    assert found.notes()[-1].endswith(": the answer still, though over the budget at the longest batch: no other "
                                      "config that ran is left")


def test_one_fixed_length_or_no_length_changes_nothing_and_verify_longest_says_why_it_ran_nothing():
    fixed = [run(4, 128, 100.0, shortest=128), run(8, 128, 110.0, shortest=128)]
    ev = evaluator(fixed, fixed[1].peak_memory_bytes)
    assert settle_longest(ev, LongestOptions(), 4096).notes() == [] and not ev.ledger.excluded
    found = settle_longest(ev, LongestOptions(verify=True), 4096)
    assert found.verified == [] and not ev.ledger.excluded
    assert found.notes() == ["--verify-longest: nothing run: every batch the runs saw has one length (128 tokens): the "
                             "runs measured the longest"]
    images = [Experiment("z0_gas1_tmbspg4", {"train_micro_batch_size_per_gpu": 4}, status=Status.OK, metric=1.0,
                         peak_memory_bytes=10**8)]  # no token ids recorded
    ev = evaluator(images, 2 * 10**8)
    assert settle_longest(ev, LongestOptions(max_seq_len=1024, verify=True), None).notes() == [
        "--verify-longest: nothing run: the runs recorded no sequence length (no token ids in the script's batches): "
        "the longest batch is not known"]


def test_a_verification_that_runs_out_of_memory_moves_the_answer_and_verifies_the_next():
    runs = [run(4, 128, 100.0), run(8, 96, 110.0)]
    ev = evaluator(runs, 10 ** 12, launched=(Status.OOM, Status.OK))  # the budget the prediction reads: ample
    found = settle_longest(ev, LongestOptions(max_seq_len=1024, verify=True), None)
    assert [(e.name, e.pad_seq_len, e.status) for e in found.verified] == [
        ("z0_gas1_tmbspg8_longest1024", 1024, Status.OOM), ("z0_gas1_tmbspg4_longest1024", 1024, Status.OK)]
    assert ev.ledger.answer.name == "z0_gas1_tmbspg4" and found.verified[0].kind is ExperimentKind.MBS
    assert found.notes()[-2:] == [
        "verified at the longest batch: z0_gas1_tmbspg8_longest1024 (every batch padded to 1024 tokens): oom",
        "verified at the longest batch: z0_gas1_tmbspg4_longest1024 (every batch padded to 1024 tokens): ran, peak "
        "200.00 MiB (predicted 116.82 MiB: -42%)"]


def test_a_verification_run_stops_at_end_profile_step_where_a_measured_run_may_be_extended(tmp_path):
    # its peak is what it is for: no stop rule watches it, so the backend launches it with the user's
    # end_profile_step, not the 5x extended exit a measured run gets (zerotune.run.backends.local)
    rule = StopRule(OBJECTIVES["throughput"])
    measured = run(4, 128, 100.0)
    verify = dataclasses.replace(measured, name="z0_gas1_tmbspg4_longest1024", pad_seq_len=1024)
    assert StreamWatch(tmp_path, rule, measured, 5).rule is rule
    assert StreamWatch(tmp_path, rule, verify, 5).rule is None
