"""A data-parallel script that uses torch's default group as a plain DDP script does, with no
rank or group passed anywhere: ``DistributedSampler(ds)``, ``dist.all_reduce`` of the loss inside
the step, ``dist.get_rank()``/``get_world_size()``, and ``dist.barrier()`` after the loop.

--digest-out gets a hash of the final weights *and* of every step's all-reduced loss, so a
metric reduction that went wrong after a recovery (or differed between ranks) shows as a digest
that differs from the fault-free run's."""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tracked_tensor import TrackedTensor

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--digest-out", default="")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    job = cl.init()
    # the default group is the job's: torch answers with the launcher's rank and world size
    assert (dist.get_rank(), dist.get_world_size()) == (job.rank, job.world_size)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(ds, shuffle=True, seed=3)  # rank and replicas from the default group
    loader = job.loader(DataLoader(ds, batch_size=8, sampler=sampler))
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    losses = torch.zeros(args.steps, dtype=torch.float64)
    job.track(losses=TrackedTensor("losses", losses))  # a replacement must know the steps before it joined
    for step in job.steps(args.steps):
        with step:
            xb, yb = loader.batch(step.index)
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            avg = loss.detach().to(torch.float64)
            # before the update: a fault in it replays the whole step; after the update the
            # step would be rolled forward without this step's metric
            dist.all_reduce(avg)
            losses[step.index] = avg / dist.get_world_size()
            opt.step()
    dist.barrier()  # every rank got here, on the generation the loop ended in
    if args.digest_out:
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in net.state_dict().values()))
        h.update(losses.numpy().tobytes())
        with open(args.digest_out.replace("{rank}", str(dist.get_rank())), "w") as f:
            f.write(h.hexdigest() + "\n")


if __name__ == "__main__":
    main()
