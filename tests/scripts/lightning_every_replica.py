"""A small Lightning DDP job in which every rank can be made to fail half-way through the same
optimizer update, so that no rank holds a whole state and the job goes back to its snapshot.

``--fail-update K`` (with ``--marker-dir``): in the update of step K each rank applies its SGD
update, waits ``--fail-wait`` seconds (every other rank is then past the step's all-reduce and
inside its own update, so no abort can stop it before it), and raises. A marker file per rank
makes this happen once per rank in the job: a spare that takes the rank over does not raise.

Same seed on every rank, the ``DistributedSampler`` Lightning injects (shuffled), a ``StepLR``
scheduler and a callback with state (a count of the updates it saw). Every rank prints the digest
of each batch it trains on (``--print-batches``), the samples it read and its callback's count as
it ends, and writes the SHA-256 of its final weights, optimizer state, learning rate and the
callback's count to --digest-out ("{rank}" filled in).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """48 fixed samples; counts the reads, so a replacement that read more than it trained shows."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


class FailingSGD(torch.optim.SGD):
    """SGD whose update of one step raises after it changed the weights (once per rank)."""

    def __init__(
        self, params: Any, step_of: Callable[[], int], fail: int, marker: Path | None, wait: float
    ) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self._step_of, self._fail, self._marker, self._wait = step_of, fail, marker, wait

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        if self._marker is not None and self._step_of() == self._fail and not self._marker.exists():
            self._marker.write_text("fired\n")
            time.sleep(self._wait)
            raise RuntimeError(f"planted: every rank fails in its update of step {self._fail}")
        return out


class UpdateCount(pl.Callback):
    """A callback with state: the updates it saw (after each batch)."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class Net(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.args = args
        self.trained = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.trained += 1
        if self.args.print_batches:
            digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
            print(f"batch rank={self.global_rank} step={self.global_step} {digest}", flush=True)
        return F.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> Any:
        a = self.args
        marker = Path(a.marker_dir) / f"failed-{self.global_rank}" if a.marker_dir else None
        opt = FailingSGD(
            self.parameters(), lambda: self.trainer.global_step, a.fail_update, marker, a.fail_wait
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fail-update", type=int, default=-1, help="the step whose update fails on every rank")
    ap.add_argument("--fail-wait", type=float, default=1.5)
    ap.add_argument("--marker-dir", help="where each rank marks that it failed (once per rank)")
    ap.add_argument("--print-batches", action="store_true")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)  # the same model on every rank
    module = Net(args)
    data = Samples()
    count = UpdateCount()
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=CheckpointlessStrategy(),
        max_steps=args.steps,
        callbacks=[count],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    pl.seed_everything(7)  # the same seed on every rank: the injected sampler's and dropout's
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, drop_last=True)
    trainer.fit(module, loader)

    print(f"reads rank={trainer.global_rank} samples={data.reads} trained={module.trained}x2", flush=True)
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    opt = trainer.optimizers[0]
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(f"lr={opt.param_groups[0]['lr']!r} count={count.count} step={trainer.global_step}".encode())
    out = Path(args.digest_out.replace("{rank}", str(trainer.global_rank)))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(h.hexdigest() + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
