"""benchmarks/compare_deepspeed.py's figures over repeated tunings: each tuner's launch spread, the per-tuning wall and
answer ratios against issue 41's targets, and the table's rows (made-up rows; no tuner runs)."""
from benchmarks.compare_deepspeed import over_tunings, ratios, render, table_text


def row(wall_s: float, launches: int, remeasured: float) -> dict:
    return {"tuning_wall_s": wall_s, "experiments_launched": launches, "launches": launches, "experiments_ok": launches,
            "reported_metric": remeasured, "remeasured_median": remeasured, "remeasured_samples_per_s": [remeasured],
            "timed_out": False, "chosen": {"stage": 0, "mbs": 16, "gas": 1, "knobs": {}},
            "load_during": {"load1_mean": 1.0, "load1_max": 2.0, "samples": 1}, "remeasure_load1_mean": 1.0}


def tuning(z: dict, d: dict) -> dict:
    block = {"order": ["zerotune", "deepspeed"], "zerotune": z, "deepspeed": d}
    return block | {"ratios": ratios(block)}


def test_three_tunings_are_held_to_issue_41s_targets_each_and_over_all():
    # issue 41's two real runs, and a third: walls 197/351 = 0.56, 434/283 = 1.53, 180/300 = 0.6; launches 8, 17, 9
    blocks = [tuning(row(197, 8, 36.0), row(351, 7, 31.0)), tuning(row(434, 17, 35.0), row(283, 7, 31.5)),
              tuning(row(180, 9, 30.0), row(300, 7, 31.0))]
    over = over_tunings(blocks, 0.6)
    assert [round(w, 2) for w in over["wall_ratios"]] == [0.56, 1.53, 0.6]
    assert [round(a, 3) for a in over["answer_ratios"]] == [1.161, 1.111, 0.968]
    assert over["zerotune"] == {"launches": [8, 17, 9], "most": 17, "fewest": 8, "most_over_fewest": 17 / 8}
    assert over["deepspeed"]["most_over_fewest"] == 1.0
    assert over["targets_met"] == {"every_wall": False, "every_answer": False, "launch_spread": False}
    assert over_tunings(blocks[:1], 0.6)["targets_met"] == {"every_wall": True, "every_answer": True,
                                                              "launch_spread": True}
    result = {"meta": {"script_name": "train_hf_loop.py", "ranks": 2, "device": "CPU", "budget_human": "3.00 GiB",
                       "steps": 15, "min_samples": 1000, "repeats": 1,
                       "autotuning_common": {"max_train_micro_batch_size_per_gpu": 32}},
              "runs": {"true": {"tunings": blocks, "over_tunings": over}}}
    text = table_text(render(result))
    assert "true #3" in text and "over 3 tunings" in text and "8-17 / 7-7" in text
    assert "zt 2.12x" in text
    assert "ratio max 1.53" in text and "ratio min 0.97" in text
