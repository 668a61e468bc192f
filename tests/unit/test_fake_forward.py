"""Activations of published model configs (tests/data/hf_configs) as `zerotune estimate` counts them on transformers'
forward over fake CPU tensors (zerotune.model.fake_forward), against a real CPU measurement.

The measurement (tests/helpers/cut_measure.py, in a process of its own): the same rule (each storage autograd saves,
once; parameters and buffers never) on a real forward of a 1-layer and a 2-layer cut of the config at 4, 8 and 12
tokens, interpolated exactly to 4,096 tokens; the L-layer model is the 1-layer cut plus L - 1 times the second layer.
All 24 take about 4 minutes of CPU, so they are recorded (tests/data/activation_cuts.json, with the pinned torch and
transformers they ran on); the test measures :data:`LIVE`'s again and holds the record to them, to the byte.
"""
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.cut_measure import RECORD, jobs, versions
from tests.helpers.hf_configs import PUBLISHED, read
from zerotune.model import fake_forward
from zerotune.model.hf_config import architecture

# measured live, the cheapest (about 40 s): GPT-2's blocks, a sliding window (Phi-3), two kinds of MoE (Qwen3's,
# DeepSeek's with latent attention)
LIVE = ("deepseek-v2-lite", "gpt2-xl", "phi-3-mini-4k", "qwen3-30b-a3b")


def test_activations_at_4096_tokens_are_within_10_percent_of_a_cpu_measurement_of_a_two_layer_cut(tmp_path):
    record = json.loads(RECORD.read_text())
    assert record["versions"] == versions(), "a new torch or transformers: python -m tests.helpers.cut_measure --record"
    (tmp_path / "jobs.json").write_text(json.dumps(jobs(LIVE)))
    subprocess.run([sys.executable, "-m", "tests.helpers.cut_measure", str(tmp_path / "jobs.json"),
                    str(tmp_path / "out.json")], check=True, capture_output=True, timeout=600,
                   cwd=Path(__file__).parents[2])
    live = json.loads((tmp_path / "out.json").read_text())
    assert len(live) == 8 and live == {k: record["cuts"][k] for k in live}
    ratios = {}
    for name, attention, s in jobs():
        first, second, layers = record["cuts"][f"{name}-{attention}"]
        counted = architecture(read(name), seq_len=s, attention=attention).activation_bytes_per_sample
        ratios[f"{name}-{attention}"] = round(counted / (first + (layers - 1) * (second - first)), 4)
        if (name, attention) == ("llama-3-8b", "sdpa"):  # flash is counted on CPU's flash kernel, SDPA's
            assert architecture(read(name), seq_len=s, attention="flash").activation_bytes_per_sample == counted
    assert len(ratios) == 2 * len(PUBLISHED) and {k: r for k, r in ratios.items() if abs(r - 1) >= 0.10} == {}
    # to the byte, but for the two sliding-window models with SDPA: at 4,096 tokens, past (Phi-3) or at (Mistral)
    # the window, transformers gives SDPA a mask of its own, which the short real runs never build
    assert {k: r for k, r in ratios.items() if r != 1} == {"mistral-7b-sdpa": 1.0995, "phi-3-mini-4k-sdpa": 1.0545}


def test_eager_attention_keeps_each_layers_scores_and_sdpa_none():
    cfg = read("llama-3-8b")
    eager, sdpa = (fake_forward.count(cfg, 4096, "bfloat16", a) for a in ("eager", "sdpa"))
    # per layer: the scores' softmax in fp32 and its bf16 copy, 32 heads x 4096^2 x (4 + 2) bytes; 32 layers; and
    # 1.5% more for the kernels' different copies of q, k, v and the output
    assert 1 < (eager.plain - sdpa.plain) / (32 * 32 * 4096 ** 2 * 6) < 1.02
    assert (eager.attention, sdpa.attention) == ("eager", "sdpa")


def test_a_model_without_sdpa_is_counted_as_eager_and_says_so():
    counted = fake_forward.count(read("gemma-2-9b"), 4096, "bfloat16", "sdpa")
    assert counted.attention == "eager"
    assert counted.note.startswith("Gemma2") and counted.note.endswith(": counted as eager")
    arch = architecture(read("gemma-2-9b"), seq_len=4096, attention="sdpa")
    assert (arch.activations_counted, counted.note in arch.notes) == ("eager", True)


def test_attention_dropout_is_not_counted_for_sdpa_and_is_for_eager():
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    dropout = fake_forward.count(gpt2, 128, "bfloat16", "sdpa")
    none = fake_forward.count({**gpt2, "attn_pdrop": 0.0}, 128, "bfloat16", "sdpa")
    assert dropout == none  # GPT2Config's attn_pdrop 0.1 would send CPU to the math kernel, which keeps the scores
    assert fake_forward.count(gpt2, 128, "bfloat16", "eager").plain > none.plain


def test_a_forward_that_fails_on_fake_tensors_is_counted_in_closed_form_and_says_so():
    # transformers runs Mixtral's experts through torch._grouped_mm, whose fake kernel takes bf16 only
    assert fake_forward.count(read("mixtral-8x7b"), 4096, "float32", "sdpa") is None
    arch = architecture(read("mixtral-8x7b"), seq_len=4096, bytes_per_activation=4, attention="sdpa")
    assert "activations by the closed form: MixtralForCausalLM's forward did not run on fake tensors" in arch.notes
    assert any(n.startswith("MoE activations: each token through 2 of 8 experts") for n in arch.notes)
