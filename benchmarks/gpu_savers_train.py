"""``examples/train_hf.py``, run unchanged (``runpy``), under an optional device-memory cap and step clock: the
one training script both tuners tune in ``benchmarks/gpu_savers.sh``, and the one its re-measure runs.

- ``GPU_SAVERS_DEVICE_BUDGET`` (bytes; unset: no cap): before the script starts, this rank's CUDA caching
  allocator is capped so that the device holds at most that many bytes, with zerotune's own rule
  (:func:`zerotune.probe.sitecustomize.cap_allocator`: fraction = (budget - what lies outside the allocator, the
  CUDA context) / total). DeepSpeed's autotuner has no budget option, so its experiments get the budget this
  way; zerotune's experiments leave it unset and zerotune's probe applies the same cap (``--device-memory``)
  at the first forward. Over it, an allocation raises CUDA's own out-of-memory error.
- ``GPU_SAVERS_CLOCK`` (a path; unset: nothing): at the end of training rank 0 appends one JSON line: samples/s
  over the optimizer steps after the first ``GPU_SAVERS_WARMUP`` (default 2, at least 1: the clock starts at a
  step's end), the device synchronised at each step's end, and the allocator's peaks (bytes).

Run as the script itself: ``deepspeed --num_gpus 1 benchmarks/gpu_savers_train.py <train_hf.py's flags>``.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_hf.py"
BUDGET_ENV, CLOCK_ENV, WARMUP_ENV = "GPU_SAVERS_DEVICE_BUDGET", "GPU_SAVERS_CLOCK", "GPU_SAVERS_WARMUP"


def cap_device(budget_bytes: int) -> None:
    """Cap this rank's CUDA device (``LOCAL_RANK``) at ``budget_bytes``, as zerotune's probe caps its ranks."""
    import torch

    from zerotune.probe.sitecustomize import cap_allocator
    if not torch.cuda.is_available():
        print(f"gpu_savers_train: no CUDA device, {BUDGET_ENV} ignored", file=sys.stderr, flush=True)
        return
    device = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)
    fraction = cap_allocator(torch.cuda, device, budget_bytes)
    print(f"gpu_savers_train: device {device}'s caching allocator capped at "
          f"{'the whole device' if fraction is None else f'{fraction:.4f} of the device'} "
          f"(budget {budget_bytes} bytes)", file=sys.stderr, flush=True)


def install_clock(path: str, warmup_steps: int) -> None:
    """Add a callback to every ``transformers.Trainer`` the script builds: rank 0 appends its timing to ``path``."""
    import torch
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.ends: list[tuple[int, float]] = []  # (optimizer step, perf_counter at its end)

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((state.global_step, time.perf_counter()))

        def on_train_end(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            timed = self.ends[max(0, warmup_steps - 1):]  # from the end of the last warm-up step
            record = {"steps": state.global_step, "timed_steps": max(0, len(timed) - 1), "seconds": None,
                      "samples_per_s": None, "mbs": args.per_device_train_batch_size,
                      "gas": args.gradient_accumulation_steps, "world_size": args.world_size,
                      "gradient_checkpointing": bool(args.gradient_checkpointing)}
            if len(timed) >= 2:
                (s0, t0), (s1, t1) = timed[0], timed[-1]
                samples = (s1 - s0) * args.per_device_train_batch_size * args.gradient_accumulation_steps \
                    * args.world_size
                record.update(seconds=round(t1 - t0, 4), samples_per_s=round(samples / (t1 - t0), 3))
            if torch.cuda.is_available():
                record.update(max_allocated_bytes=int(torch.cuda.max_memory_allocated()),
                              max_reserved_bytes=int(torch.cuda.max_memory_reserved()))
            print(f"gpu_savers_train: {json.dumps(record)}", flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    init = transformers.Trainer.__init__

    def init_with_clock(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(StepClock())

    transformers.Trainer.__init__ = init_with_clock


def main() -> None:
    if os.environ.get(BUDGET_ENV):
        cap_device(int(os.environ[BUDGET_ENV]))
    if os.environ.get(CLOCK_ENV):
        install_clock(os.environ[CLOCK_ENV], int(os.environ.get(WARMUP_ENV, "2")))
    sys.argv[0] = str(SCRIPT)
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
