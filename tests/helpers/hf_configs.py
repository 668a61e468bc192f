"""The published model configs of tests/data/hf_configs (their config.json files as released, no download)
and what their model cards state."""
import json
from pathlib import Path

CONFIGS = Path(__file__).parent.parent / "data" / "hf_configs"
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
