"""The memory model's coverage of a config's keys (zerotune.model.coverage): what it does not price is named by the
summary and by `zerotune estimate`, never ignored silently."""
import json

from zerotune import cli
from zerotune.core.experiment import Experiment, Status
from zerotune.core.objective import Objective
from zerotune.model.coverage import unmodelled_keys

Z = "zero_optimization"
NEW_KEYS = {"train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": 4,
            Z: {"stage": 3, "reduce_bucket_size": 5e8, "mics_shard_size": 8, "zero_hpz_partition_size": 8,
                "zero_quantized_weights": True, "stage3_gather_16bit_weights_on_model_save": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3}},
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "fp16": {"enabled": False, "loss_scale": 0},
            "compile": {"deepcompile": True, "passes": ["z3"]}, "tensor_parallel": {"autotp_size": 2},
            "gradient_checkpointing": True}


def test_the_keys_the_memory_model_does_not_price_are_found_and_the_rest_are_not():
    # priced since (zerotune.model.zero_options): hpZ, the offload ratio, the 16-bit master and states, AutoTP, SP
    assert unmodelled_keys(NEW_KEYS) == [f"{Z}.mics_shard_size", f"{Z}.zero_quantized_weights", "compile.deepcompile",
                                         "compile.passes"]
    # what zerotune prices or knows to hold no device memory: nothing to name
    assert unmodelled_keys({Z: {"stage": 2, "overlap_comm": True, "allgather_bucket_size": 2e8,
                                "offload_optimizer": {"device": "none"}}, "bf16": {"enabled": True},
                            "compile": {"enabled": False, "passes": ["z3"]}, "tensor_parallel": {"autotp_size": 1},
                            "sequence_parallel_size": 1}) == []


def test_the_summary_names_the_unpriced_keys_of_the_launched_configs():
    from zerotune.report.notes import strategy_notes
    from zerotune.strategy.ledger import Ledger
    from zerotune.strategy.result import StrategyResult

    ledger = Ledger(Objective.named("throughput"))
    ledger.add(Experiment("z3_mics", NEW_KEYS, status=Status.OK, metric=10.0))
    ledger.add(Experiment("z3", {Z: {"stage": 3, "mics_shard_size": 8}}, status=Status.OK, metric=9.0))
    notes = strategy_notes(StrategyResult(ledger=ledger), 2**30, 8)
    assert notes[-2:] == [
        f"not in the memory model: {Z}.mics_shard_size, {Z}.zero_quantized_weights, compile.deepcompile, "
        "compile.passes (set in the launched configs): its predictions for them leave these keys out; what they move "
        "is in the measured peaks only",
        "memory model: tensor_parallel.autotp_size 2: every parameter counted as sharded over 2 ranks (the embeddings "
        "and norms AutoTP keeps whole are under-counted) and the activations as measured or given"]


def test_estimate_names_each_unpriced_key_of_its_deepspeed_config(tmp_path, capsys):
    (tmp_path / "ds.json").write_text(json.dumps({Z: {"stage": 3, "mics_shard_size": 8},
                                                  "bf16": {"enabled": True, "bf16_optimizer_states": True}}))
    code = cli.main(["estimate", "--num-params", "1e9", "--num_gpus", "8", "--device-memory", "80GiB",
                     "--deepspeed", str(tmp_path / "ds.json")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line for line in lines if "not in the memory model" in line.lower()] == [
        f"Not in the memory model: {Z}.mics_shard_size: the bytes above leave them out."]
