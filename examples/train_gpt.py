"""A small GPT-style causal language model trained with DeepSpeed.

Plain PyTorch plus ``deepspeed.initialize``; it knows nothing of zerotune. The data are token
sequences generated on the fly (a noisy repeating pattern), so no download is needed.

Run it with the ``deepspeed`` launcher, e.g.::

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/train_gpt.py \
        --deepspeed_config examples/ds_config.json
"""
import argparse
import json
import math
import time

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layer: int, n_head: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(mbs: int, seq_len: int, vocab: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (mbs, 1), generator=g)
        step = torch.randint(1, 7, (mbs, 1), generator=g)
        seq = (start + step * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=g) < 0.05
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--report-throughput", metavar="PATH", default=None,
                        help="rank 0 writes the samples/s of the steps after --warmup-steps to PATH (JSON)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="optimizer steps left out of --report-throughput's timing")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.report_throughput is not None and not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps ({args.warmup_steps}) must be >= 0 and less than --steps ({args.steps})")

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq_len, args.d_model, args.n_layer, args.n_head)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    data = batches(engine.train_micro_batch_size_per_gpu(), args.seq_len, args.vocab, seed=engine.global_rank,
                   device=engine.device)
    report = args.report_throughput is not None and engine.global_rank == 0
    timed_from = time.perf_counter()  # end of the warm-up steps (the start, without warm-up)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, targets = next(data)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        if report and step == args.warmup_steps - 1:
            loss.item()  # the step's work is done
            timed_from = time.perf_counter()
        if engine.global_rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} ppl {math.exp(min(loss.item(), 20)):.1f}", flush=True)
    if report:
        loss.item()
        seconds = time.perf_counter() - timed_from
        steps = args.steps - args.warmup_steps
        samples = steps * engine.train_batch_size()
        with open(args.report_throughput, "w") as f:
            json.dump({"samples_per_s": samples / seconds, "seconds": seconds, "timed_steps": steps,
                       "warmup_steps": args.warmup_steps, "train_batch_size": engine.train_batch_size(),
                       "micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
                       "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                       "world_size": engine.world_size}, f, indent=2)
            f.write("\n")
    # end the process group before the interpreter exits: left to exit-time destructors, a rank's CPU
    # communication thread can still be joinable and abort the rank ("terminate called without an active
    # exception", 1 run in 6 of a 2-step run here)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
