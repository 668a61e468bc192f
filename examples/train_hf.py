"""A Hugging Face ``Trainer`` script as people write them, with no zerotune import.

A tiny GPT-2 built from a config (random weights, nothing downloaded) trains on synthetic tokens;
every training option is the Trainer's own (``TrainingArguments``), so DeepSpeed comes in through
``--deepspeed ds_config.json``, whose ``"auto"`` values the Trainer fills from these arguments::

    deepspeed --num_gpus 2 examples/train_hf.py --output_dir /tmp/hf --max_steps 20 \\
        --per_device_train_batch_size 4 --deepspeed examples/ds_config_hf.json

and zerotune tunes it unchanged (``autotuning.arg_mappings`` passes each experiment's micro batch
size and gradient accumulation steps as ``--per_device_train_batch_size`` and
``--gradient_accumulation_steps``; see the README). ``--arch llama`` trains a Llama instead, which
DeepSpeed's Ulysses sequence parallelism shards under ``accelerate launch`` with a ``parallelism_config``
(each sample carries its ``position_ids``, as Ulysses asks).
"""
from dataclasses import dataclass

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)


@dataclass
class ModelArguments:
    """The model and data: a GPT-2 (or Llama) of this size, trained on random tokens."""

    arch: str = "gpt2"
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    seq_len: int = 64
    n_positions: int = 0  # position embeddings (0: seq_len); more is parameters with no work per sample
    vocab_size: int = 1024
    num_samples: int = 8192


class SyntheticTokens(torch.utils.data.Dataset):
    """``num_samples`` sequences of random token ids (the labels are the inputs: causal LM)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[i]
        return {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(len(tokens))}


def main() -> None:
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    positions = model_args.n_positions or model_args.seq_len
    if model_args.arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=model_args.n_layer, hidden_size=model_args.n_embd, num_attention_heads=model_args.n_head,
            intermediate_size=4 * model_args.n_embd, max_position_embeddings=positions,
            vocab_size=model_args.vocab_size, attn_implementation="sdpa"))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=model_args.n_layer, n_embd=model_args.n_embd,
                                           n_head=model_args.n_head, n_positions=positions,
                                           vocab_size=model_args.vocab_size))
    data = SyntheticTokens(model_args.num_samples, model_args.seq_len, model_args.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps, loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
