"""A Lightning job with ``Trainer(accumulate_grad_batches=3)``: one optimizer update (one job step)
is a window of 3 micro-batches.

28 samples, 2 per batch, on 2 ranks: an epoch is 7 batches per rank, so its windows are batches
0-2, 3-5 and the lone batch 6, on which Lightning steps because it ends the epoch. Dropout draws
from the global generator, ``self.log(..., on_epoch=True)`` sums the inputs, an EMA callback with
state updates after every micro-batch, and a step-wise scheduler changes the learning rate.

``--fault-at MICRO SPEC`` injects SPEC (``--inject`` syntax, its step a job step) when the window
of that step reaches its micro-batch MICRO (0 first), as that micro-batch's forward begins: a
fault in the middle of a window, which the launcher's own ``--inject`` (first forward of a step)
cannot place. ``--ckpt-dir`` adds a ``ModelCheckpoint`` there (rank 0 writes every 4 updates, and
``last.ckpt``); ``--resume CKPT`` fits from that checkpoint (``ckpt_path=``). Every rank prints
each micro-batch it trains on, and writes the SHA-256 of its
final weights, optimizer state and EMA to --digest-out ("{rank}" filled in).
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


class Net(pl.LightningModule):
    def __init__(self, faults: list[tuple[int, str]]) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.faults = faults  # (micro-batch, spec): injected once each, as that micro-batch begins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        micro = batch_idx % self.trainer.accumulate_grad_batches
        for at, spec in list(self.faults):
            step = int(dict(p.split("=", 1) for p in spec.split(":")[1:])["step"])
            if (at, step) == (micro, self.global_step):
                checkpointless.init().inject(spec)  # fires at the forward below, if not fired yet
                self.faults.remove((at, spec))
        x, y = batch
        loss = F.mse_loss(self(x), y)  # through __call__: the job's forward site
        self.log("loss", loss)
        self.log("x_sum", x.sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
        print(f"micro rank={self.global_rank} step={self.global_step} batch={batch_idx} {digest}", flush=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Ema(pl.Callback):
    """An EMA of the weights, after every micro-batch (state: travels with the replica)."""

    def __init__(self) -> None:
        self.avg: dict[str, torch.Tensor] = {}
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.seen += 1
        for k, v in module.state_dict().items():
            self.avg[k] = v.detach().clone() if k not in self.avg else 0.8 * self.avg[k] + 0.2 * v.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"avg": {k: v.clone() for k, v in self.avg.items()}, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.avg = {k: v.clone() for k, v in state["avg"].items()}
        self.seen = int(state["seen"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault-at", nargs=2, action="append", default=[], metavar=("MICRO", "SPEC"))
    ap.add_argument("--print-batches", action="store_true", help="ignored: always printed")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--ckpt-dir", help="a ModelCheckpoint writes here")
    ap.add_argument("--resume", help="fit from this checkpoint (ckpt_path=)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    pl.seed_everything(0)  # the same model and data on every rank
    module = Net([(int(m), spec) for m, spec in args.fault_at])
    data = TensorDataset(torch.randn(28, 8), torch.randn(28, 1))
    ema = Ema()
    saving = [
        pl.callbacks.ModelCheckpoint(args.ckpt_dir, every_n_train_steps=4, save_top_k=-1, save_last=True)
    ]
    saving = saving if args.ckpt_dir else []
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=CheckpointlessStrategy(),
        max_steps=args.steps,
        accumulate_grad_batches=3,
        callbacks=[ema, *saving],
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=2, shuffle=True, drop_last=True), ckpt_path=args.resume)

    opt = trainer.optimizers[0]
    state = {**module.state_dict(), **{f"ema.{k}": v for k, v in ema.avg.items()}}
    for i, s in opt.state_dict()["state"].items():
        state.update({f"opt{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    x_sum = float(trainer.callback_metrics["x_sum"])
    print(f"epoch metric rank={trainer.global_rank} x_sum={x_sum!r} seen={ema.seen}", flush=True)
    extra = repr((opt.param_groups[0]["lr"], ema.seen)).encode()
    write_digest(args.digest_out, trainer.global_rank, state, extra)


if __name__ == "__main__":
    main()
