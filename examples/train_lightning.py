"""A Lightning script with ``DeepSpeedStrategy``, as people write them, with no zerotune import.

Lightning starts its own ranks under plain ``python`` (or takes torchrun's), and its ``DeepSpeedStrategy`` reads the
DeepSpeed config from ``PL_DEEPSPEED_CONFIG_PATH`` when it is given none, so zerotune tunes it as::

    PL_DEEPSPEED_CONFIG_PATH=ds_config.json zerotune tune --num_gpus 2 -- python examples/train_lightning.py
    PL_DEEPSPEED_CONFIG_PATH=ds_config.json zerotune tune -- torchrun --nproc_per_node 2 examples/train_lightning.py

Lightning's DeepSpeed strategy runs on CUDA devices only (on CPU ranks it raises "The DeepSpeed strategy is only
supported on CUDA GPUs"; docs/decisions.md D314). Needs ``pip install lightning``.
"""
import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy


class Regression(L.LightningModule):
    """A small MLP regressing random targets."""

    def __init__(self, width: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width,
                                                                                                              width))

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="the DataLoader's batch size (the mbs)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(4096, args.width), torch.randn(4096, args.width))
    trainer = L.Trainer(accelerator="cuda", devices=args.devices, strategy=DeepSpeedStrategy(), max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regression(args.width), torch.utils.data.DataLoader(data, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
