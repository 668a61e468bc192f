"""Published model configs (tests/data/hf_configs: their config.json files as released, no download) counted by the
model transformers builds on the meta device (zerotune.model.meta_model), and `zerotune estimate` saying so."""
import json
from pathlib import Path

import pytest

from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.model.hf_config import architecture

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
# name: (parameters, active per token, (k, E)), as the model cards state them (DeepSeek's 2.4B active leaves out its
# 0.42B of embeddings; these include them)
PUBLISHED = {
    "gpt2-xl": (1_557_611_200, 1_557_611_200, (0, 0)),
    "llama-3-8b": (8_030_261_248, 8_030_261_248, (0, 0)),
    "llama-3-70b": (70_553_706_496, 70_553_706_496, (0, 0)),
    "mistral-7b": (7_241_732_096, 7_241_732_096, (0, 0)),
    "qwen2-7b": (7_615_616_512, 7_615_616_512, (0, 0)),
    "qwen3-8b": (8_190_735_360, 8_190_735_360, (0, 0)),  # head_dim 128 over hidden 4096 / 32 heads: the same
    "phi-3-mini-4k": (3_821_079_552, 3_821_079_552, (0, 0)),
    "gemma-2-9b": (9_241_705_984, 9_241_705_984, (0, 0)),  # head_dim 256, not hidden 3584 / 16 heads = 224
    "llava-1.5-7b": (7_063_427_072, 7_063_427_072, (0, 0)),  # the language model, the CLIP tower, the projector
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248, (2, 8)),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704, (8, 128)),
    "deepseek-v2-lite": (15_706_484_224, 2_661_150_208, (6, 64)),  # latent attention, 2 shared experts
}


def read(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


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
    assert "(MixtralForCausalLM on the meta device), seq_len 4096, attention sdpa (transformers' default; its CUDA " \
           "kernels store no scores): 46,702,792,704 parameters (46,702,792,704 trainable; 12,879,925,248 active per " \
           "token: 2 of 8 experts, embeddings included)" in out
    assert "Assumed: MoE activations: each token through 2 of 8 experts of MLP width 14336, counted as one MLP of " \
           "width 28672 in every layer." in out.splitlines()


def test_moe_activations_count_the_routed_and_shared_experts_widths():
    dense = read("deepseek-v2-lite")
    arch = architecture(dense, seq_len=1024)
    # 6 routed experts of 1408 and 2 shared of 1408: one MLP of 11264 per layer (s*h*(18 + 4*ffn/h) + 5*a*s^2)
    s, h, heads, layers, vocab = 1024, 2048, 16, 27, 102400
    assert arch.activation_bytes_per_sample == int(layers * (s * h * (18 + 4 * 11264 / h) + 5 * heads * s * s)
                                                   + 6 * s * vocab)
    assert "shared experts of width 2816" in " ".join(arch.notes)


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
