"""A Hugging Face GPT-2 trained by a plain DeepSpeed loop (no Trainer): the benchmarks' HF workload.

transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config`` (random weights, nothing downloaded) on synthetic
tokens; the micro batch size and the rest come from ``--deepspeed_config``, as in ``examples/train_gpt.py``, and as
there ``--report-throughput PATH`` has rank 0 write the wall-clock samples/s of the steps after ``--warmup-steps`` to
PATH (JSON: ``samples_per_s``, ``seconds``, ``timed_steps`` and the batch), what ``benchmarks.compare_deepspeed``
re-measures an answer with. The default size (4 layers of width 512, a 16,384-token vocabulary, 21M parameters,
sequences of 128) steps in about a second on 2 CPU ranks; ``--arch llama`` builds a LLaMA instead (AutoTP shards
it). ``--long-seq-len L --long-every K`` mixes lengths: every K-th micro batch holds L tokens, the others
``--seq-len`` (the data a tuning's few steps may never show its longest batch from)::

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 benchmarks/train_hf_loop.py --steps 10 \\
        --deepspeed_config examples/ds_config.json
"""
import argparse
import json
import time

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to train")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                        help="llama: a LlamaForCausalLM of the same width (intermediate 2x, as many KV heads as "
                             "heads), which DeepSpeed's AutoTP shards (it refuses GPT-2)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--long-seq-len", type=int, default=0,
                        help="mixed lengths: every --long-every-th micro batch holds this many tokens (0: none)")
    parser.add_argument("--long-every", type=int, default=0, help="see --long-seq-len")
    parser.add_argument("--report-throughput", metavar="PATH", default=None,
                        help="rank 0 writes the samples/s of the steps after --warmup-steps to PATH (JSON)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="optimizer steps left out of that timing")
    parser.add_argument("--step-wait", type=float, default=0.0,
                        help="seconds to sleep after each optimizer step: a stand-in for a data loader's time per step")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.report_throughput is not None and not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps ({args.warmup_steps}) must be >= 0 and less than --steps ({args.steps})")

    deepspeed.init_distributed()
    torch.manual_seed(0)
    positions = max(args.seq_len, args.long_seq_len)
    model = (GPT2LMHeadModel(GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                        n_positions=positions, vocab_size=args.vocab)) if args.arch == "gpt2" else
             LlamaForCausalLM(LlamaConfig(hidden_size=args.n_embd, intermediate_size=2 * args.n_embd,
                                          num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                                          num_key_value_heads=args.n_head, max_position_embeddings=positions,
                                          vocab_size=args.vocab)))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    # the ranks of an AutoTP group see the same batch, the data-parallel ranks different ones
    generator = torch.Generator().manual_seed(engine.global_rank // autotp_size(args.deepspeed_config))
    mbs = engine.train_micro_batch_size_per_gpu()
    micro = 0
    timed_from = time.perf_counter()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            micro += 1
            long = args.long_seq_len and args.long_every and micro % args.long_every == 0
            length = args.long_seq_len if long else args.seq_len
            tokens = torch.randint(0, args.vocab, (mbs, length), generator=generator).to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        time.sleep(args.step_wait)
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)  # .item() waits for the step's work
        if step == args.warmup_steps - 1:
            timed_from = time.perf_counter()
    if args.report_throughput is not None and engine.global_rank == 0:
        write_report(args.report_throughput, engine, time.perf_counter() - timed_from, args.steps - args.warmup_steps)
    torch.distributed.destroy_process_group()


def autotp_size(config_path: str | None) -> int:
    """The config's ``tensor_parallel.autotp_size`` (1 without one)."""
    if not config_path:
        return 1
    with open(config_path) as f:
        section = json.load(f).get("tensor_parallel") or {}
    return max(1, int(section.get("autotp_size") or 1))


def write_report(path: str, engine, seconds: float, steps: int) -> None:
    """The throughput of ``steps`` timed steps that took ``seconds``, with the batch that gives it, as JSON."""
    batch = {"train_batch_size": engine.train_batch_size(), "world_size": engine.world_size,
             "micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
             "gradient_accumulation_steps": engine.gradient_accumulation_steps()}
    report = {"samples_per_s": steps * batch["train_batch_size"] / seconds, "seconds": seconds, "timed_steps": steps}
    with open(path, "w") as f:
        f.write(json.dumps({**report, **batch}, indent=2) + "\n")


if __name__ == "__main__":
    main()
