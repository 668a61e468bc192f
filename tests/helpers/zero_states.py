"""Run as 2 ranks (``torchrun --nproc_per_node 2``, ``DS_ACCELERATOR=cpu``): for each DeepSpeed config in the JSON file
named by argv[1], a real engine over a bias-free MLP of 4 x (256 x 256) linear layers (262,144 parameters) with
torch's AdamW, one training step, and what rank 0 holds, in bytes, written as one JSON line per config to argv[2]:
the optimizer step's master partition, the optimizer states (Adam's two moments), the hpZ secondary partitions
(after the backward pass),
the parameters' own elements on the rank, and ZeRO-3's optimizer sub-groups."""
import json
import os
import sys

import deepspeed
import torch

WIDTH, LAYERS = 256, 4


def held(engine) -> dict:
    opt = engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", [])
    states = [v for s in opt.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    params = list(engine.module.parameters())
    return {"master": sum(t.numel() * t.element_size() for t in masters),
            "master_dtype": str(masters[0].dtype) if masters else "",
            "states": sum(t.numel() * t.element_size() for t in states),
            "secondary": sum(p.ds_secondary_tensor.numel() * p.ds_secondary_tensor.element_size()
                             for p in params if getattr(p, "ds_secondary_tensor", None) is not None),
            "sub_groups": len(getattr(opt, "fp16_partitioned_groups_flat", [])),
            "params": sum(p.numel() for p in params)}


def main() -> None:
    configs = json.loads(open(sys.argv[1]).read())
    deepspeed.init_distributed(dist_backend="gloo")
    lines = []
    for config in configs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config={**config, "zero_allow_untested_optimizer": True})
        x = torch.randn(2, WIDTH, dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        secondary = held(engine)["secondary"]  # the step drops the secondary partitions; the next forward remakes them
        engine.step()
        lines.append(json.dumps({**held(engine), "secondary": secondary}))
        engine.destroy()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[2], "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
