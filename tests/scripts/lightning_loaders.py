"""A Lightning job with two training loaders (a list, which Lightning combines in its default
``max_size_cycle`` mode) of different lengths, into each of which Lightning injects its
``DistributedSampler``.

On 2 ranks: 40 samples in batches of 2, shuffled (10 batches an epoch per rank), and 12 samples
in batches of 2, in order (3 batches per rank, started again after each 3rd: 3 1/3 times an
epoch). ``training_step`` trains on both batches. Every rank prints each batch it trains on
(``batch rank=R step=S DIGEST``, both loaders' samples), and as the fit ends the samples it read
from each loader against the batches it trained, and a digest of Lightning's loop state; it
writes the SHA-256 of its final weights, optimizer state and learning rate to --digest-out
("{rank}" filled in).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from adopt import write_digest  # tests/scripts is the script's own directory
from torch import nn
from torch.utils.data import DataLoader, Dataset

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed random samples; counts the reads (a replacement must read none before its step)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.trained: set[int] = set()  # the steps this process trained (a replay counts once)

    def training_step(self, batch: list[list[torch.Tensor]], batch_idx: int) -> torch.Tensor:
        loss = sum(F.mse_loss(self.body(x), y) for x, y in batch)
        data = b"".join(t.numpy().tobytes() for pair in batch for t in pair)
        digest = hashlib.sha256(data).hexdigest()[:16]
        print(f"batch rank={self.global_rank} step={self.global_step} {digest}", flush=True)
        self.trained.add(self.global_step)
        return loss  # type: ignore[return-value]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    pl.seed_everything(0)  # the same model on every rank
    module = Net()
    long, short = Counted(40, 1), Counted(12, 2)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=CheckpointlessStrategy(),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = [DataLoader(long, batch_size=2, shuffle=True), DataLoader(short, batch_size=2)]
    trainer.fit(module, loaders)

    rank = trainer.global_rank
    print(
        f"reads rank={rank} long={long.reads} short={short.reads} trained={len(module.trained)}", flush=True
    )
    loops = json.dumps(trainer.fit_loop.state_dict(), sort_keys=True, default=str)
    print(f"loops rank={rank} {hashlib.sha256(loops.encode()).hexdigest()[:16]}", flush=True)
    opt = trainer.optimizers[0]
    state = dict(module.state_dict())
    for i, s in opt.state_dict()["state"].items():
        state.update({f"opt{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    write_digest(args.digest_out, rank, state, repr(opt.param_groups[0]["lr"]).encode())


if __name__ == "__main__":
    main()
