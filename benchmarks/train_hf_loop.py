"""A Hugging Face GPT-2 trained by a plain DeepSpeed loop (no Trainer): the benchmarks' HF workload.

transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config`` (random weights, nothing downloaded) on synthetic
tokens; the micro batch size and the rest come from ``--deepspeed_config``, as in ``examples/train_gpt.py``, and as
there ``--report-throughput PATH`` has rank 0 write the wall-clock samples/s of the steps after ``--warmup-steps`` to
PATH (JSON: ``samples_per_s``, ``seconds``, ``timed_steps`` and the batch), what ``benchmarks.compare_deepspeed``
re-measures an answer with. The default size (4 layers of width 512, a 16,384-token vocabulary, 21M parameters,
sequences of 128) steps in about a second on 2 CPU ranks; ``--arch llama`` builds a LLaMA instead (AutoTP shards
it). A config's ``sequence_parallel_size`` s > 1 runs Ulysses (DeepSpeed's ``UlyssesSPAttentionHF`` over sdpa, its mpu
passed to ``deepspeed.initialize``): each rank of a group takes 1/s of every sequence and its share of the loss
(D336). ``--long-seq-len L --long-every K`` mixes lengths: every K-th micro batch holds L tokens, the others
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
    sp = config_int(args.deepspeed_config, "sequence_parallel_size")
    mpu = ulysses(model, sp, config_int(args.deepspeed_config, "train_micro_batch_size_per_gpu")) if sp > 1 else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), mpu=mpu)
    # the ranks of an AutoTP or Ulysses group see the same batch, the data-parallel ranks different ones
    tp = config_int(args.deepspeed_config, "tensor_parallel", "autotp_size")
    generator = torch.Generator().manual_seed(engine.global_rank // (tp * sp))
    sp_rank = torch.distributed.get_rank(mpu.get_sequence_parallel_group()) if mpu is not None else 0
    mbs = engine.train_micro_batch_size_per_gpu()
    micro = 0
    timed_from = time.perf_counter()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            micro += 1
            long = args.long_seq_len and args.long_every and micro % args.long_every == 0
            length = args.long_seq_len if long else args.seq_len
            tokens = torch.randint(0, args.vocab, (mbs, length), generator=generator).to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss if sp == 1 else shard_loss(engine, tokens, sp, sp_rank)
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


def config_int(config_path: str | None, *keys: str) -> int:
    """The config's integer at ``keys`` (``sequence_parallel_size``; ``tensor_parallel``, ``autotp_size``): 1 where
    absent or not above 1."""
    if not config_path:
        return 1
    with open(config_path) as f:
        value = json.load(f)
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def ulysses(model, sp: int, mbs: int):
    """Register Ulysses attention of degree ``sp`` with transformers for ``model`` (sdpa underneath) and return the
    mpu holding its groups, for ``deepspeed.initialize``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=mbs,
        seq_length_is_variable=True)


def shard_loss(engine, tokens: torch.Tensor, sp: int, sp_rank: int) -> torch.Tensor:
    """This rank's share of a Ulysses group's forward over ``tokens`` (mbs x length, the same on every rank of the
    group): the ``sp_rank``-th 1/``sp`` of the sequence with its positions, and the mean next-token loss of that
    shard (labels shifted before sharding; the last position has none). Equal shards make the ranks' averaged
    gradients those of the whole sequence's mean loss."""
    mbs, length = tokens.shape
    if length % sp:
        raise SystemExit(f"sequence length {length} is not divisible by sequence_parallel_size {sp}")
    shift = torch.cat([tokens[:, 1:], torch.full((mbs, 1), -100, dtype=tokens.dtype, device=tokens.device)], dim=1)
    positions = torch.arange(length, device=tokens.device).expand(mbs, -1)
    part = slice(sp_rank * length // sp, (sp_rank + 1) * length // sp)
    logits = engine(input_ids=tokens[:, part], position_ids=positions[:, part]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift[:, part].reshape(-1),
                                             ignore_index=-100)


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
