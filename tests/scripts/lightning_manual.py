"""A Lightning job with manual optimization and two optimizers: every ``training_step`` makes two
updates, each after its own backward (and so its own gradient all-reduce), the second on the
output of the model the first has just changed, as a GAN's generator and discriminator steps do.

The head (optimizer A, SGD with momentum) is updated first, then the encoder (optimizer B, Adam,
a step-wise scheduler stepped by the script). 16 samples, 2 per batch, on 2 ranks: an epoch is 4
batches; 10 batches make 20 optimizer steps (Lightning's ``global_step``). Dropout draws from the
global generator, and ``self.log(..., on_epoch=True)`` sums the inputs.

``--after-first-update SPEC`` injects SPEC (``--inject`` syntax, its step a job step, i.e. a
batch) once that step's first update is applied: with ``site=allreduce`` the fault fires in the
second backward's all-reduce, between the two updates. ``--ckpt-dir`` adds a ``ModelCheckpoint``
there (rank 0 writes every 8 optimizer steps, 4 batches); ``--resume CKPT`` fits from that
checkpoint (``ckpt_path=``). Every rank prints each batch it trains on
and writes the SHA-256 of its final weights, both optimizers' state, the learning rates and
``global_step`` to --digest-out ("{rank}" filled in).
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from adopt import write_digest  # tests/scripts is the script's own directory
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import checkpointless
from checkpointless.integrations.lightning import CheckpointlessStrategy


class TwoUpdates(pl.LightningModule):
    def __init__(self, faults: list[str]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, 1)
        self.faults = faults  # injected once each, after its step's first update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()  # type: ignore[attr-defined]
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx
        x, y = batch
        loss_a = F.mse_loss(self(x), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        for spec in list(self.faults):
            if int(dict(p.split("=", 1) for p in spec.split(":")[1:])["step"]) == step:
                checkpointless.init().inject(spec)  # fires at its site, if not fired yet
                self.faults.remove(spec)
        loss_b = F.mse_loss(self(x), y)  # the head just updated
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.lr_schedulers().step()  # type: ignore[union-attr]
        self.log("loss", loss_b)
        self.log("x_sum", x.sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
        print(f"manual rank={self.global_rank} step={step} gs={self.global_step} {digest}", flush=True)

    def configure_optimizers(self) -> Any:
        opt_a = torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)
        opt_b = torch.optim.Adam(self.enc.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
        return [opt_a, opt_b], [sched]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--after-first-update", action="append", default=[], metavar="SPEC")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--ckpt-dir", help="a ModelCheckpoint writes here")
    ap.add_argument("--resume", help="fit from this checkpoint (ckpt_path=)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    pl.seed_everything(0)  # the same model and data on every rank
    module = TwoUpdates(list(args.after_first_update))
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    saving = [pl.callbacks.ModelCheckpoint(args.ckpt_dir, every_n_train_steps=8, save_top_k=-1)]
    saving = saving if args.ckpt_dir else []
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=CheckpointlessStrategy(),
        max_steps=2 * args.batches,  # manual optimization: global_step counts every update
        callbacks=list[pl.Callback](saving),
        logger=False,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=2, shuffle=True, drop_last=True), ckpt_path=args.resume)

    state = dict(module.state_dict())
    for o, opt in enumerate(trainer.optimizers):
        for i, s in opt.state_dict()["state"].items():
            state.update({f"opt{o}.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    x_sum = float(trainer.callback_metrics["x_sum"])
    print(f"epoch metric rank={trainer.global_rank} x_sum={x_sum!r} gs={trainer.global_step}", flush=True)
    lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
    write_digest(args.digest_out, trainer.global_rank, state, repr((lrs, trainer.global_step)).encode())


if __name__ == "__main__":
    main()
