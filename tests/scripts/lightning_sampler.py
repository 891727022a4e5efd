"""A Lightning job whose ranks shuffle their own data: ``Trainer(use_distributed_sampler=False)``
and ``DataLoader(shuffle=True)`` on every rank, each rank's global generators seeded with its own
seed (so each rank's ``RandomSampler`` draws its own permutation, and its dropout its own masks).

16 samples, 2 per batch: an epoch is 8 steps, so a fault after step 8 is in the second epoch, and
a replacement's catch-up walks across an epoch's end. ``--log-dir`` adds a ``CSVLogger`` there
(rank 0 writes ``metrics.csv``). Every rank prints the digest of each batch it trains on and
writes the SHA-256 of its final weights to --digest-out ("{rank}" filled in).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Net(pl.LightningModule):
    def __init__(self, print_batches: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.print_batches = print_batches

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.body(x), y)
        self.log("loss", loss)
        self.log("x_sum", x.sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        if self.print_batches:
            digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
            print(f"batch rank={self.global_rank} step={self.global_step} {digest}", flush=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-dir", help="a CSVLogger writes here")
    ap.add_argument("--print-batches", action="store_true")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)  # the same model and data on every rank
    module = Net(args.print_batches)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    logger: Any = pl.loggers.CSVLogger(args.log_dir, name="lit") if args.log_dir else False
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=CheckpointlessStrategy(),
        max_steps=args.steps,
        use_distributed_sampler=False,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    pl.seed_everything(100 + trainer.global_rank)  # each rank its own shuffle and dropout
    trainer.fit(module, DataLoader(data, batch_size=2, shuffle=True, drop_last=True))

    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    x_sum = trainer.callback_metrics.get("x_sum")
    if x_sum is not None:
        print(f"epoch metric rank={trainer.global_rank} x_sum={float(x_sum)!r}", flush=True)
    out = Path(args.digest_out.replace("{rank}", str(trainer.global_rank)))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(h.hexdigest() + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
