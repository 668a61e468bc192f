"""A TRL ``SFTTrainer`` script as people write them, with no zerotune import: supervised fine-tuning of a small
causal LM, optionally through a LoRA adapter (PEFT; the base model frozen).

Nothing is downloaded: the model is a Llama built from a config (random weights), the tokenizer a word-level one
built here, the data synthetic sentences. Every training option is TRL's own (``SFTConfig``, a ``TrainingArguments``),
so DeepSpeed comes in as Accelerate's users bring it::

    accelerate launch --config_file zero.yaml examples/train_trl.py --output_dir /tmp/sft --max_steps 20 \\
        --per_device_train_batch_size 4 [--lora]

Needs TRL and PEFT (``pip install trl peft``; ``make setup`` installs the tested versions).
"""
from dataclasses import dataclass

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

WORDS = ["the", "model", "learns", "a", "small", "pattern", "of", "words", "in", "order", "and", "then", "repeats",
         "it", "again", "with", "some", "noise"]


@dataclass
class ModelArguments:
    """The model, its adapter and the data."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_samples: int = 1024
    lora: bool = False  # train a LoRA adapter (rank 8) on the attention projections, the base frozen
    lora_rank: int = 8


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS`, built in memory."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def sentences(n: int) -> Dataset:
    """``n`` sentences of 8 to 24 words, each a rotation of :data:`WORDS`."""
    return Dataset.from_dict({"text": [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 17))
                                       for i in range(n)]})


def main() -> None:
    model_args, args = HfArgumentParser((ModelArguments, SFTConfig)).parse_args_into_dataclasses()
    tok = tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=model_args.hidden_size, intermediate_size=4 * model_args.hidden_size,
                         num_hidden_layers=model_args.num_layers, num_attention_heads=model_args.num_heads,
                         max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    peft_config = None
    if model_args.lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=model_args.lora_rank, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=sentences(model_args.num_samples),
                         processing_class=tok, peft_config=peft_config)
    result = trainer.train()
    if trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(f"trained {result.global_step} steps, loss {result.training_loss:.4f}, {trainable} trainable "
              "parameters", flush=True)


if __name__ == "__main__":
    main()
