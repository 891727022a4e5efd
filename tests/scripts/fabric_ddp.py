"""A Lightning Fabric loop adopted with CheckpointlessFabricStrategy (issue 38: Fabric).

Fabric's usual calls (``launch``, ``setup``, ``setup_dataloaders`` with its injected
``DistributedSampler``, ``backward``, ``all_reduce``, ``barrier``); the adoption is the strategy,
``job.track`` and the ``job.steps`` loop, with Fabric's loader made step-addressable by ``strategy.loader``.
Dropout draws from the global generator. --digest-out gets a hash of the final weights, the AdamW
state and every step's averaged loss, so a reduction that went wrong after a recovery shows too.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tracked_tensor import TrackedTensor

from checkpointless.integrations.fabric import CheckpointlessFabricStrategy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--digest-out", default="")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    strategy = CheckpointlessFabricStrategy()
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    fabric.launch()
    job = strategy.job
    fabric.seed_everything(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(net, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = strategy.loader(fabric.setup_dataloaders(DataLoader(ds, batch_size=8, shuffle=True)))
    losses = torch.zeros(args.steps, dtype=torch.float64)
    job.track(model=net, optimizer=opt, losses=TrackedTensor("losses", losses))
    for step in job.steps(args.steps):
        with step:
            xb, yb = loader.batch(step.index)
            loss = F.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            fabric.backward(loss)
            avg = fabric.all_reduce(loss.detach().to(torch.float64), reduce_op="mean")
            losses[step.index] = avg
            optimizer.step()
        if step.committed and fabric.global_rank == 0 and step.index % 10 == 0:
            fabric.print(f"step {step.index} loss {float(losses[step.index]):.5f}")
    fabric.barrier()
    if args.digest_out:
        h = hashlib.sha256()
        for t in [*net.state_dict().values(), losses]:
            h.update(t.detach().contiguous().numpy().tobytes())
        for s in opt.state_dict()["state"].values():
            for v in s.values():
                h.update(torch.as_tensor(v).contiguous().numpy().tobytes())
        Path(args.digest_out.format(rank=job.rank)).write_text(h.hexdigest())


if __name__ == "__main__":
    main()
