"""job.epochs() with a learning-rate scheduler stepped after each epoch (the per-epoch work), and
a metric all-reduced after each update: a fault in the last step of an epoch, after the update,
rolls that step forward, and every rank's scheduler must still step once per epoch.

--mesh R,S shards the model with FSDP2 over that mesh (job.device_mesh, fully_shard) instead of
data parallelism: with R = 1 and no buddy copies a lost rank's shard exists only in snapshots, so
the job rolls back, across an epoch's end when the newest snapshot is in an earlier epoch.

Every rank writes the SHA-256 of its final weights (its shards) to --digest-out ("{rank}" filled in).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from adopt import Points, write_digest
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument(
        "--die-after-update", type=int, default=-1, help="rank 1 SIGKILLs itself 1 s after this step's update"
    )
    ap.add_argument("--mesh", help="R,S: FSDP2 over this mesh instead of data parallelism")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    job = cl.init()
    ds = Points(48)
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)
    if args.mesh:
        mesh = job.device_mesh(("replicate", "shard"), tuple(int(n) for n in args.mesh.split(",")))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        # the optimizer must see the sharded parameters fully_shard put in place
        opt = torch.optim.SGD(net.parameters(), lr=0.2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    else:
        model = job.data_parallel(net)
    job.track(model=net, optimizer=opt, scheduler=sched)
    for _epoch in job.epochs(args.epochs, dl):
        if job.epoch_abandoned:  # only from an abandoned epoch's inner loop to its next epoch
            print(f"rank {job.rank} starts epoch {_epoch} marked abandoned", flush=True)
        for step in job.epoch_steps():
            with step:
                x, y = step.batch
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step.index == args.die_after_update and job.rank == 1 and not job.is_replacement:
                    # the others have applied their update by then and wait in the metric's
                    # all-reduce: the step is rolled forward, whatever the machine's speed
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGKILL)
                job.all_reduce(loss.detach())  # a metric, reduced after the update
        if job.epoch_abandoned:  # a rollback left this epoch; its work runs, and is undone
            print(f"rank {job.rank} abandoned epoch {_epoch}", flush=True)
        sched.step()  # the per-epoch work

    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in net.state_dict().items()}
    write_digest(args.digest_out, job.rank, local, repr(sched.state_dict()["last_epoch"]).encode())


if __name__ == "__main__":
    main()
