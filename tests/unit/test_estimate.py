"""``zerotune estimate`` and the model sources it reads: exact bytes, and bad input refused naming the argument."""
import json
import sys

import pytest

from zerotune.cli import main
from zerotune.model.hf_config import architecture

# Tiny configs; the parameter counts are what transformers 5.23 builds from them
# (AutoModelForCausalLM.from_config(...), sum of numel).
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
         "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False}
OPT = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
       "vocab_size": 1000, "max_position_embeddings": 128}
QWEN2 = {**LLAMA, "model_type": "qwen2"}


@pytest.mark.parametrize("cfg,params", [(GPT2, 172_288), (LLAMA, 220_480), ({**LLAMA, "tie_word_embeddings": True}, 156_480),
                                        (OPT, 172_416), (QWEN2, 220_736)])
def test_hf_parameter_counts_match_transformers(cfg, params):
    assert architecture(cfg).num_params == params


def test_hf_activations_follow_korthikanti_where_transformers_does_not_know_the_type():
    closed = {**GPT2, "model_type": "my_gpt2"}  # no transformers class: the closed form
    a = architecture(closed)
    # per layer s*h*(18 + 4*ffn/h) + 5*a*s^2 = 128*64*34 + 5*4*128^2 = 278,528 + 327,680; 2 layers; logits 6*s*V
    assert (a.activation_bytes_per_sample, a.activations_counted) == (2 * (278_528 + 327_680) + 6 * 128 * 1000, "")
    assert architecture(closed, attention="sdpa").activation_bytes_per_sample == 2 * 278_528 + 6 * 128 * 1000
    assert architecture(closed, seq_len=64, bytes_per_activation=4).activation_bytes_per_sample == \
        2 * (2 * (64 * 64 * 34 + 5 * 4 * 64 * 64) + 6 * 64 * 1000)
    # checkpointing: each layer keeps its input 2*s*h, one layer is recomputed at a time
    assert architecture(closed, checkpointing=True).activation_bytes_per_sample == \
        2 * (2 * 128 * 64) + (278_528 + 327_680) + 6 * 128 * 1000
    a = architecture(GPT2)
    assert (a.largest_layer_params, a.seq_len) == (64_000, 128)  # the token embedding
    # persistent (<= 1e5 elements): every tensor of this tiny model
    assert a.persistent_params == a.num_params


def run(capsys, *argv):
    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_num_params_json_exact(capsys):
    code, out, _ = run(capsys, "--num-params", "1e6", "--activation-bytes", "1000", "--num_gpus", "2", "--num_nodes",
                       "2", "--device-memory", "20000000", "--json")
    assert code == 0
    est = json.loads(out)
    assert (est["dp_world_size"], est["precision"], est["optimizer"]) == (4, "bf16", "AdamW")
    rows = {(r["stage"], r["offload"]): r for r in est["rows"]}
    assert len(rows) == 8
    z2 = rows[(2, "none")]
    # bf16: params 2*Psi, grads (2 + 4)*Psi/4, optimizer (8 + 4)*Psi/4, one 5e8-element bf16 bucket and
    # the reduction's flat copy 2*Psi: over 20 MB
    assert (z2["parameters"], z2["gradients"], z2["optimizer_states"], z2["buffers"]) == \
        (2_000_000, 1_500_000, 3_000_000, 1_002_000_000)
    assert z2["max_mbs"] == 0
    z0 = rows[(0, "none")]
    # stage 0: 2 + 6 + 12 bytes/param + bucket 2*Psi = 22,000,000 > 20,000,000 (the activations, freed
    # before the reduction's copy, add nothing)
    assert (z0["total_mbs1"], z0["max_mbs"]) == (22_000_000, 0)


def test_estimate_max_mbs_and_host_check(capsys):
    code, out, _ = run(capsys, "--num-params", "1e6", "--activation-bytes", "1000", "--num_gpus", "4",
                       "--device-memory", "1100000000", "--host-memory", "5MB", "--json")
    rows = {(r["stage"], r["offload"]): r for r in json.loads(out)["rows"]}
    z3 = rows[(3, "none")]
    # params 2*Psi/4 + 2*Psi gathered, grads 6*Psi/4, optimizer 12*Psi/4, bucket 1e9, the reduce-scatter's
    # copy 2*Psi and the all-gather buffer 2*Psi: 1,011,000,000 fixed; the bucket holds all of T, so the
    # reduction runs after the backward and the activations share the copy's room
    assert z3["total_mbs1"] == 1_011_000_000
    assert (z3["max_mbs"], z3["activations_max_mbs"]) == (1024, 1_024_000)  # the cap
    off = rows[(3, "optimizer cpu")]
    # host per rank: grad partition 2*Psi/4 + fp32 grad 4*Psi/4 + master 4*Psi/4 + Adam 8*Psi/4 = 4.5 MB; 4 ranks
    assert (off["host_per_node"], off["fits_host"]) == (18_000_000, False)


def test_estimate_from_a_profile_run_and_a_hf_config(tmp_path, capsys):
    prof = tmp_path / "profile"
    prof.mkdir()
    (prof / "model_info.json").write_text(json.dumps({"num_params": 1_000_000, "trainable_num_params": 250_000,
                                                      "activation_mem_per_gpu": 1_000_000}))
    code, out, _ = run(capsys, "--profile", str(prof), "--num_gpus", "2", "--device-memory", "1GB", "--precision",
                       "fp32", "--json")
    est = json.loads(out)
    assert (code, est["trainable_params"], est["precision"]) == (0, 250_000, "fp32")
    z0 = next(r for r in est["rows"] if r["stage"] == 0)
    # fp32 stage 0, 250,000 trainable: params 4*1e6, grads 4*T, Adam 8*T, bucket 4*T; then 1 MB per sample
    assert (z0["parameters"], z0["gradients"], z0["optimizer_states"], z0["buffers"]) == \
        (4_000_000, 1_000_000, 2_000_000, 1_000_000)
    # the activations of the first sample share their room with the 1,000,000-byte copy made after the backward
    assert z0["max_mbs"] == (1_000_000_000 - 8_000_000 + 1_000_000) // 1_000_000
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GPT2))
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--seq-len", "64", "--num_gpus", "8", "--device-memory", "80GiB")
    assert code == 0 and "172,288 parameters" in out and "seq_len 64" in out and "does not fit" not in out


@pytest.mark.parametrize("argv,names", [
    ([], "--profile, --num-params or --hf-config"),
    (["--num-params", "1e9", "--hf-config", "x.json"], "(got --num-params, --hf-config)"),
    (["--num-params", "lots"], "--num-params = 'lots'"),
    (["--num-params", "-5"], "--num-params = '-5'"),
    (["--num-params", "1e9"], "--device-memory is required"),
    (["--num-params", "1e9", "--device-memory", "40 bananas"], "--device-memory = '40 bananas'"),
    (["--num-params", "1e9", "--device-memory", "40GiB", "--host-memory", "0"], "--host-memory = '0'"),
    (["--num-params", "1e9", "--device-memory", "40GiB", "--seq-len", "512"], "--seq-len goes with --hf-config"),
    (["--num-params", "1e9", "--trainable-params", "2e9", "--device-memory", "40GiB"], "--trainable-params 2e9"),
    (["--num-params", "1e9", "--device-memory", "40GiB", "--num_gpus", "3", "--mp-size", "2"], "--mp-size 2"),
    (["--hf-config", "/nonexistent/config.json", "--device-memory", "40GiB"], "--hf-config /nonexistent/config.json"),
    (["--profile", "/nonexistent", "--device-memory", "40GiB"], "--profile /nonexistent"),
    (["--num-params", "1e9", "--device-memory", "40GiB", "--deepspeed", "/nonexistent.json"], "--deepspeed /nonexistent.json"),
])
def test_estimate_bad_input_names_the_argument(capsys, argv, names):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert names in err


def test_estimate_hf_config_without_sizes_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**GPT2, "n_head": "four"}))
    code, _, err = run(capsys, "--hf-config", str(cfg), "--device-memory", "1GiB")
    assert code == 2 and "n_head = 'four'" in err
    cfg.write_text(json.dumps({"model_type": "resnet"}))
    code, _, err = run(capsys, "--hf-config", str(cfg), "--device-memory", "1GiB")
    assert code == 2 and "no hidden size" in err


def test_estimate_hf_config_rows_with_activation_checkpointing_off_and_on(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GPT2))
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "2", "--device-memory", "40000000", "--json")
    # the default attention, transformers' SDPA, keeps no scores (counted on GPT2LMHeadModel's own forward)
    assert (json.loads(out)["activation_bytes_per_sample"], json.loads(out)["model_source"].split(", ", 2)[2]) == (
        1_619_468, "attention sdpa (transformers' default; its CUDA kernels store no scores)")
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "2", "--device-memory", "40000000", "--json",
                       "--attention", "eager")
    est = json.loads(out)
    # eager keeps, in each of 2 layers, the 4 heads' 128 x 128 scores, softmax and dropout output in bf16, 393,216
    # bytes, where SDPA keeps a log-sum-exp of 4 x 128 fp32, 2,048: 782,336 more; checkpointed (one layer
    # recomputed at a time), 423,936 more
    assert (est["activation_bytes_per_sample"], est["checkpointed_activation_bytes_per_sample"]) == \
        (1_619_468 + 782_336, 1_108_492 + 423_936)
    rows = {(r["stage"], r["offload"], r["checkpointing"]): r for r in est["rows"]}
    assert len(rows) == 16 and [r["checkpointing"] for r in est["rows"][:2]] == [False, True]
    off, on = rows[(0, "none", False)], rows[(0, "none", True)]
    # stage 0 bf16, Psi = 172,288: params 2*Psi, grads 6*Psi, AdamW and master 12*Psi, the flat copy 2*Psi:
    # 3,790,336 fixed; the activations share the copy's 344,576 bytes (reduced after the backward), so the room
    # is 40,000,000 - 3,790,336 + 344,576 = 36,554,240 bytes: 15 samples of 2,401,804, 23 of 1,532,428
    assert (off["activations_mbs1"], off["max_mbs"], off["activations_max_mbs"]) == (2_401_804, 15, 15 * 2_401_804)
    assert (on["activations_mbs1"], on["max_mbs"], on["activations_max_mbs"]) == (1_532_428, 23, 23 * 1_532_428)
    # at mbs 1 the activations, larger than the copy, take its place: 3,790,336 - 344,576 + activations
    assert (off["total_mbs1"], on["total_mbs1"]) == (3_445_760 + 2_401_804, 3_445_760 + 1_532_428)
    # --activation-checkpointing: the checkpointed rows only
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "2", "--device-memory", "40000000",
                       "--activation-checkpointing", "--json", "--attention", "eager")
    rows = json.loads(out)["rows"]
    assert len(rows) == 8 and all(r["checkpointing"] for r in rows) and rows[0]["max_mbs"] == 23
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "2", "--device-memory", "40000000",
                       "--attention", "eager")
    table = [line.split()[:3] for line in out.splitlines()[3:6]]
    assert "2.29 MiB per sample (1.46 MiB with activation checkpointing)" in out
    assert table == [["stage", "offload", "ckpt"], ["0", "none", "off"], ["0", "none", "on"]]


def test_estimate_from_a_profile_run_that_priced_checkpointing(tmp_path, capsys):
    prof = tmp_path / "profile"
    prof.mkdir()
    (prof / "model_info.json").write_text(json.dumps({"num_params": 1_000_000, "activation_mem_per_gpu": 9_999_999}))
    (prof / "activations.json").write_text(json.dumps({"saved_bytes": 2_000_000, "checkpointed_bytes": 600_000,
                                                       "checkpoint_layers": 4, "micro_batch_size": 2}))
    code, out, _ = run(capsys, "--profile", str(prof), "--num_gpus", "2", "--device-memory", "1GB", "--json")
    est = json.loads(out)
    assert (est["activation_bytes_per_sample"], est["checkpointed_activation_bytes_per_sample"]) == (1_000_000, 300_000)
    z0 = [r for r in est["rows"] if r["stage"] == 0]
    # bf16 stage 0: 2 + 6 + 12 bytes a parameter and the 2*Psi flat copy, 22,000,000 fixed; the activations share
    # the copy's 2,000,000 bytes: (1,000,000,000 - 20,000,000) // 1,000,000 = 980, // 300,000 = 3,266
    assert [(r["checkpointing"], r["activations_mbs1"], r["max_mbs"]) for r in z0] == \
        [(False, 1_000_000, 980), (True, 300_000, 1024)]  # the cap
    (prof / "activations.json").write_text(json.dumps({"saved_bytes": 2_000_000, "micro_batch_size": 2}))
    code, _, err = run(capsys, "--profile", str(prof), "--num_gpus", "2", "--device-memory", "1GB",
                       "--activation-checkpointing")
    assert code == 2 and "did not price activation checkpointing" in err
    code, _, err = run(capsys, "--num-params", "1e9", "--device-memory", "40GiB", "--activation-checkpointing")
    assert code == 2 and "--activation-checkpointing goes with --hf-config or --profile" in err


# Llama-2-7b-hf's config.json without hidden_act: transformers' LlamaConfig defaults it to silu (a gated MLP,
# three matrices); AutoModelForCausalLM.from_config builds 6,738,415,616 parameters.
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
             "torch_dtype": "float16", "vocab_size": 32000}
SILU_NOTE = "hidden_act not in the config: LlamaConfig's default 'silu'"


def test_hf_keys_the_config_omits_take_the_model_types_defaults():
    a = architecture(LLAMA2_7B)
    assert (a.num_params, a.notes) == (6_738_415_616, (SILU_NOTE,))
    # LlamaConfig's tie_word_embeddings is False: the head is counted apart, as transformers builds it
    untied = architecture({k: v for k, v in LLAMA2_7B.items() if k != "tie_word_embeddings"})
    assert (untied.num_params, untied.notes) == \
        (6_738_415_616, ("tie_word_embeddings not in the config: LlamaConfig's default False", SILU_NOTE))
    # a config that gives every key assumes nothing; a key set to null is derived (kv heads = heads), not defaulted
    assert architecture(LLAMA).notes == ()
    assert architecture({**QWEN2, "num_key_value_heads": None}).num_params == \
        architecture({**QWEN2, "num_key_value_heads": 4}).num_params


def test_hf_fallback_defaults_are_transformers_own(monkeypatch):
    from zerotune.model import hf_config
    for mtype, (name, defaults) in hf_config.FALLBACK_DEFAULTS.items():
        assert hf_config.type_defaults(mtype) == (name, defaults, False)
    # transformers not importable: the same count from zerotune's copy, and the note says so
    monkeypatch.setitem(sys.modules, "transformers.models.auto.configuration_auto", None)
    a = architecture(LLAMA2_7B)
    assert (a.num_params, a.notes, a.built_by) == (6_738_415_616, (
        SILU_NOTE + " (transformers not importable: zerotune's copy)",
        "parameters counted by zerotune's closed form (transformers builds no llama model here): a dense gated "
        "(3-matrix) MLP of width 11008 per layer, RMSNorm, no biases, rotary positions, head_dim = hidden 4096 / 32 "
        "heads"), "")


def test_estimate_names_the_defaults_it_assumed(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "8", "--device-memory", "80GiB")
    assert code == 0 and "6,738,415,616 parameters" in out and f"Assumed: {SILU_NOTE}." in out.splitlines()
    code, out, _ = run(capsys, "--hf-config", str(cfg), "--num_gpus", "8", "--device-memory", "80GiB", "--json")
    assert json.loads(out)["notes"] == [SILU_NOTE]
