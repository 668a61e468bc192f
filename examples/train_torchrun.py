"""The GPT of ``train_gpt.py`` as a torchrun script is written: strict argparse, no ``--local_rank``.

torchrun gives each rank ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in its environment and no argument of its own,
so this script's parser knows only its own flags (an unknown one, such as ``--local_rank=0``, is an error), and the
DeepSpeed config comes in as ``--deepspeed_config``. It knows nothing of zerotune::

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 torchrun --nproc_per_node 2 examples/train_torchrun.py \\
        --deepspeed_config examples/ds_config.json
"""
import argparse
import os

import deepspeed
import torch
from train_gpt import GPT, batches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True, help="the DeepSpeed config (JSON)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    args = parser.parse_args()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            parser.error(f"${name} is not set: start this script with torchrun")

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq_len, args.d_model, args.n_layer, args.n_head)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    data = batches(engine.train_micro_batch_size_per_gpu(), args.seq_len, args.vocab, seed=engine.global_rank,
                   device=engine.device)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, targets = next(data)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} (rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}, "
                  f"local world {os.environ['LOCAL_WORLD_SIZE']})", flush=True)
    torch.distributed.destroy_process_group()  # as train_gpt.py: no rank aborts in the interpreter's teardown


if __name__ == "__main__":
    main()
