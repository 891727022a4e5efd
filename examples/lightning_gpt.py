"""The GPT of train_gpt.py as a LightningModule, trained by a Lightning Trainer.

Plain Lightning DDP (2 processes, Lightning starts them):

    python examples/lightning_gpt.py --strategy ddp --devices 2

Under checkpointless, surviving faults in process (the three lines marked "checkpointless"
below are the whole adoption):

    checkpointless run --nproc 3 --spares 1 --inject kill:rank=1:step=4 examples/lightning_gpt.py

At the end every rank prints/writes the SHA-256 of its final weights (--digest-out, with {rank}),
so a run with faults can be compared bit for bit with one without.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import GPT, weights_digest, write_digest

from checkpointless.integrations.lightning import CheckpointlessStrategy  # checkpointless


class TokenWindows(Dataset[torch.Tensor]):
    """Sample i: seq_len+1 tokens, from a token file or from a generator seeded by (seed, i)."""

    def __init__(self, path: str | None, seq_len: int, seed: int, size: int = 4096) -> None:
        self.seq_len, self.seed = seq_len, seed
        self.ds: Any = None
        self.vocab, self.size = 256, size
        self.reads = 0  # samples read on this process (tests: a replacement reads none it skips)
        if path:
            from checkpointless.data import TokenDataset

            self.ds = TokenDataset.open(path, verify="quick")
            self.vocab, self.size = self.ds.vocab_size, self.ds.num_samples(seq_len)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        if self.ds is not None:
            return torch.from_numpy(self.ds.sample(i, self.seq_len).astype("int64"))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)


class LitGPT(pl.LightningModule):
    def __init__(self, vocab: int, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.vocab = vocab
        self.gpt = GPT(vocab, args.dim, args.layers, args.heads, args.seq_len, args.dropout)
        self.trained: set[int] = set()  # the steps this process ran training_step for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)  # type: ignore[no-any-return]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))
        self.log("loss", loss, prog_bar=False)
        self.trained.add(self.global_step)
        if self.args.print_batches:  # which samples each rank trained on, per step (tests)
            digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
            print(f"batch rank={self.global_rank} step={self.global_step} {digest}", flush=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        x, y = batch[:, :-1], batch[:, 1:]
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.args.steps))
        if not self.args.plateau:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        # halves the rate whenever the validation loss has not risen (mode="max": nearly always),
        # so that its state shows in the weights
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)
        every = {"interval": "step", "frequency": self.args.plateau}
        return [opt], [
            {"scheduler": sched, "interval": "step"},
            {"scheduler": plateau, "monitor": "val_loss", **every},
        ]


class WeightEMA(pl.Callback):
    """An exponential moving average of the weights, updated after every optimizer step: a
    callback with state, which a replacement receives with the replica (state_dict)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.shadow = {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        weights = module.state_dict()
        with torch.no_grad():
            for k, v in self.shadow.items():
                v.mul_(self.decay).add_(weights[k].detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


class StepTimes(pl.Callback):
    """Rank 0 prints when each step ended (wall clock), for benchmarks/lightning_recovery.py."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            print(f"steptime {trainer.global_step} {time.time():.6f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=12, help="sequences per step over all ranks")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", help="token file from `checkpointless data prepare` (default: random tokens)")
    ap.add_argument("--strategy", default="checkpointless", help="checkpointless, or ddp for plain Lightning")
    ap.add_argument("--devices", type=int, default=1, help="processes Lightning starts (ddp only)")
    ap.add_argument("--ckpt-dir", help="keep Lightning checkpoints here (ModelCheckpoint, every 5 steps)")
    ap.add_argument("--resume", action="store_true", help="ckpt_path='last' (Lightning's restart path)")
    ap.add_argument(
        "--ema", type=float, help="keep an EMA of the weights with this decay (a stateful callback)"
    )
    ap.add_argument(
        "--catch-up",
        choices=("seek", "reread"),
        default="seek",
        help="how a replacement reaches its step in Lightning's loop (reread: the old walk, to compare)",
    )
    ap.add_argument(
        "--val-every",
        type=int,
        default=0,
        help="validate every N batches on --val-batches batches (0: never)",
    )
    ap.add_argument("--val-batches", type=int, default=2)
    ap.add_argument(
        "--plateau", type=int, default=0, help="a ReduceLROnPlateau on val_loss every N batches (0: none)"
    )
    ap.add_argument("--step-times", action="store_true")
    ap.add_argument("--print-reads", action="store_true", help="print the samples read as the fit ends")
    ap.add_argument("--print-batches", action="store_true")
    ap.add_argument("--digest-out", help="write the final weights' SHA-256 here; {rank} is filled in")
    args = ap.parse_args()

    pl.seed_everything(args.seed, workers=True)  # the same seed on every rank
    data = TokenWindows(args.data, args.seq_len, args.seed)
    module = LitGPT(data.vocab, args)
    strategy: Any = (
        CheckpointlessStrategy(catch_up=args.catch_up) if args.strategy == "checkpointless" else args.strategy
    )  # checkpointless
    callbacks: list[Any] = [StepTimes()] if args.step_times else []
    ema = WeightEMA(args.ema) if args.ema else None
    if ema is not None:
        callbacks.append(ema)
    if args.ckpt_dir:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=5, save_last=True)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,  # under checkpointless, `checkpointless run --nproc` decides the ranks
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        # validation inside the fit: a replacement's seek counts the runs before its step
        val_check_interval=args.val_every or None,
        limit_val_batches=args.val_batches if args.val_every else 0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    world = trainer.world_size
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    loader = DataLoader(data, batch_size=args.global_batch // world, shuffle=True, drop_last=True)
    resume = args.resume and args.ckpt_dir and (Path(args.ckpt_dir) / "last.ckpt").exists()
    # a held-out set of its own (its reads are not the training data's)
    val = TokenWindows(args.data, args.seq_len, args.seed + 1) if args.val_every else None
    val_loader = DataLoader(val, batch_size=args.global_batch // world) if val is not None else None
    trainer.fit(module, loader, val_loader, ckpt_path="last" if resume else None)

    if args.print_reads:  # the samples this process read, against the batches it trained on
        per_batch = args.global_batch // world
        print(
            f"reads rank={trainer.global_rank} samples={data.reads} trained={len(module.trained)}x{per_batch}",
            flush=True,
        )
        # and where Lightning's loops stand (what a checkpoint would hold): a replacement that
        # sought its step must end where an uninterrupted rank does
        loops = json.dumps(trainer.fit_loop.state_dict(), sort_keys=True, default=str)
        print(
            f"loops rank={trainer.global_rank} {hashlib.sha256(loops.encode()).hexdigest()[:16]}", flush=True
        )
    digest = weights_digest(module)
    if ema is not None:  # the average is part of what a run must end with, bitwise
        h = hashlib.sha256(digest.encode())
        for k, v in sorted(ema.shadow.items()):
            h.update(k.encode())
            h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
        digest = h.hexdigest()
    if trainer.global_rank == 0:
        print(f"final weights sha256 {digest}", flush=True)
    if args.digest_out:
        write_digest(Path(args.digest_out.replace("{rank}", str(trainer.global_rank))), digest)


if __name__ == "__main__":
    main()
