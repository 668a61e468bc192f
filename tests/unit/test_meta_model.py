"""Published model configs (tests/data/hf_configs: their config.json files as released, no download) counted by the
model transformers builds on the meta device (zerotune.model.meta_model), and `zerotune estimate` saying so."""
import json

import pytest

from tests.helpers.hf_configs import CONFIGS, PUBLISHED, read
from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.model.hf_config import architecture


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_config_is_counted_as_transformers_builds_it(name):
    arch = architecture(read(name), seq_len=4096)
    assert (arch.num_params, arch.active_params, arch.experts) == PUBLISHED[name]
    assert arch.built_by.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    assert not any(n.startswith("parameters counted by zerotune's closed form") for n in arch.notes)


def test_estimate_says_mixtrals_total_and_active_parameters_and_how_its_activations_are_counted(capsys):
    code = cli.main(["estimate", "--hf-config", str(CONFIGS / "mixtral-8x7b.json"), "--num_gpus", "8",
                     "--device-memory", "80GiB", "--seq-len", "4096"])
    out = capsys.readouterr().out
    assert code == 0
    assert "(MixtralForCausalLM on the meta device; activations counted on its sdpa forward over fake CPU tensors), " \
           "seq_len 4096, attention sdpa (transformers' default; its CUDA kernels store no scores): 46,702,792,704 " \
           "parameters (46,702,792,704 trainable; 12,879,925,248 active per token: 2 of 8 experts, embeddings " \
           "included), activations 43.15 GiB per sample (2.94 GiB with activation checkpointing)" in out
    assert "Assumed:" not in out


def test_moe_activations_grow_with_the_experts_each_token_runs():
    def saved(k: int) -> int:
        return architecture({**read("deepseek-v2-lite"), "num_experts_per_tok": k}, seq_len=1024, attention="sdpa") \
            .activation_bytes_per_sample
    # each routed token's pass through one expert keeps the same bytes, in each of the 26 MoE layers (the first of
    # 27 is dense): k = 6 keeps three times what k = 1 keeps above k = 0... measured from k = 1 and 2
    assert saved(6) - saved(3) == 3 * (saved(2) - saved(1)) > 0
    assert architecture(read("deepseek-v2-lite"), seq_len=1024).activations_counted == "eager"


def test_a_vision_language_config_names_the_activations_it_leaves_out():
    arch = architecture(read("llava-1.5-7b"), seq_len=4096)
    assert "activations of the language model (llama text_config) only: the vision tower's (clip_vision_model) are " \
           "not counted" in arch.notes


def test_a_type_transformers_does_not_know_is_counted_in_closed_form_and_says_what_it_assumed():
    cfg = {**read("llama-3-8b"), "model_type": "my_llama"}
    arch = architecture(cfg, seq_len=4096)
    # a type zerotune's tables do not know either: GPT-2's layout (LayerNorm, learned positions; no biases, as the
    # config's attention_bias says), each assumption named
    h, kv, ffn, layers, vocab, positions = 4096, 8 * 128, 14336, 32, 128256, 8192
    layer = 2 * h * h + 2 * h * kv + 2 * h * ffn + 2 * 2 * h  # q, o, k, v, a 2-matrix MLP, two LayerNorms
    assert arch.built_by == "" and arch.num_params == layers * layer + 2 * h + (vocab + positions + vocab) * h
    assert arch.notes == ("parameters counted by zerotune's closed form (transformers builds no my_llama model here): "
                          "a dense 2-matrix MLP of width 14336 per layer, LayerNorm, no biases, learned positions, "
                          "head_dim = hidden 4096 / 32 heads",)


def test_a_config_transformers_refuses_is_exit_2_naming_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**read("llama-3-8b"), "hidden_size": 4096.5}))  # once truncated to 4096
    code = cli.main(["estimate", "--hf-config", str(bad), "--num_gpus", "1", "--device-memory", "80GiB"])
    err = capsys.readouterr().err
    assert code == 2 and f"--hf-config {bad}: transformers cannot build a llama model from it" in err
    assert "hidden_size" in err and "4096.5" in err


def test_a_config_of_a_trillion_layers_is_counted_by_arithmetic_not_a_list_of_its_tensors():
    from zerotune.model.meta_model import MAX_LAYERS
    one, two = (architecture({**read("llama-3-8b"), "num_hidden_layers": n}) for n in (1, 2))  # built on meta
    big = architecture({**read("llama-3-8b"), "num_hidden_layers": 10**12})  # beyond MAX_LAYERS: the closed form
    assert 10**12 > MAX_LAYERS and big.built_by == "" and one.built_by == "LlamaForCausalLM"
    assert big.num_params == two.num_params + (two.num_params - one.num_params) * (10**12 - 2)  # once a MemoryError


def test_heads_that_do_not_divide_the_hidden_size_without_a_head_dim_are_refused(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**read("llama-3-8b"), "hidden_size": 16}))  # 32 heads of width 0.5
    code = cli.main(["estimate", "--hf-config", str(bad), "--num_gpus", "1", "--device-memory", "80GiB"])
    assert code == 2 and capsys.readouterr().err == (
        f"zerotune: error: --hf-config {bad}: hidden size 16 is not a multiple of 32 attention heads, and no head_dim "
        "says the heads' width\n")
    # a type transformers knows is refused in its own words, head_dim or not; the closed form takes a stated head_dim
    with pytest.raises(ConfigError, match="The hidden size .16. is not a multiple of the number of attention heads"):
        architecture({**read("llama-3-8b"), "hidden_size": 16, "head_dim": 8})
    assert architecture({**read("llama-3-8b"), "model_type": "my_llama", "hidden_size": 16, "head_dim": 8}).built_by \
        == ""


def test_active_parameters_skip_the_routed_experts_a_token_does_not_run():
    from zerotune.model.meta_model import MetaModel
    # 8 experts of 10 parameters, 2 per token: 60 of the 80 skipped; unknown expert count or k: all active
    assert MetaModel("M", 100, 10, 0, routed_params=80, num_experts=8, experts_per_token=2).active_params == 40
    assert MetaModel("M", 100, 10, 0, routed_params=80, num_experts=0, experts_per_token=2).active_params == 100
    assert MetaModel("M", 100, 10, 0, routed_params=80, num_experts=8, experts_per_token=0).active_params == 100
