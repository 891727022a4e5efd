"""An adopted HSDP 2x2 script whose ranks build *different* initial weights (seeded by rank), as
a script that seeds each process differently would. Only the job's start transfer (each rank
takes its shard's state from the rank that holds it in the first replica group) makes the two
replicas of each shard equal, and then they train identically.

--digest-out: each rank writes a hash of its own shards to the path with "{rank}" filled in. Each
rank also prints how much of a superseded communicator (its gloo group, its stores) its default
group holds parked: under plain torchrun the mesh must reuse the default group that init()
formed, not form it a second time."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--digest-out", required=True)
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    job = cl.init()
    mesh = job.device_mesh(("replicate", "shard"), (2, 2))
    torch.manual_seed(100 + job.rank)  # every rank its own initial weights
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job.track(model=model, optimizer=opt)
    for step in job.steps(args.steps):
        with step:
            x = torch.linspace(-1, 1, 32).reshape(4, 8) * (step.index + 1)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to_local().contiguous().numpy().tobytes())
    Path(args.digest_out.format(rank=job.rank)).write_text(h.hexdigest())
    world = dist.distributed_c10d._get_default_group()
    print(f"rank {job.rank}: default group parks {len(world._graveyard)} item(s)", flush=True)


if __name__ == "__main__":
    main()
