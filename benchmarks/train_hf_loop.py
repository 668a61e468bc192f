"""A Hugging Face GPT-2 trained by a plain DeepSpeed loop (no Trainer): the benchmarks' HF workload.

transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config`` (random weights, nothing downloaded) on synthetic
tokens; the micro batch size and the rest come from ``--deepspeed_config``, as in ``examples/train_gpt.py``.
The default size (4 layers of width 512, a 16,384-token vocabulary, 21M parameters, sequences of 128) steps in
about a second on 2 CPU ranks. ``--long-seq-len L --long-every K`` mixes lengths: every K-th micro batch holds L
tokens, the others ``--seq-len`` (the data a tuning's few steps may never show its longest batch from)::

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 benchmarks/train_hf_loop.py --steps 10 \\
        --deepspeed_config examples/ds_config.json
"""
import argparse

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to train")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--long-seq-len", type=int, default=0,
                        help="mixed lengths: every --long-every-th micro batch holds this many tokens (0: none)")
    parser.add_argument("--long-every", type=int, default=0, help="see --long-seq-len")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                       n_positions=max(args.seq_len, args.long_seq_len), vocab_size=args.vocab))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    generator = torch.Generator().manual_seed(engine.global_rank)
    mbs = engine.train_micro_batch_size_per_gpu()
    micro = 0
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            micro += 1
            long = args.long_seq_len and args.long_every and micro % args.long_every == 0
            length = args.long_seq_len if long else args.seq_len
            tokens = torch.randint(0, args.vocab, (mbs, length), generator=generator).to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
