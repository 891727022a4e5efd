"""A data-parallel script whose step uses groups it makes itself, as frameworks do:
``dist.new_group([0, 1])`` (a subgroup; the other ranks get ``GroupMember.NON_GROUP_MEMBER``),
``dist.new_group(backend="gloo", timeout=timedelta(days=10000))`` (Lightning's ``prepare_data``
group: every rank, a timeout past what poll() accepts), ``dist.new_subgroups_by_enumeration``
(pairs) and ``dist.split_group`` (of the world into [0, 2] and [1], and of ``[0, 1]`` by its own
ranks only), all made after ``checkpointless.init()`` and before ``job.steps()``.

Every step reduces the loss on each of them: the subgroup's sum is broadcast to every rank over
the gloo group, and the pairs' sums are summed over the gloo group; both go into --digest-out with
the final weights, with each split group's sum, so a reduction that went wrong after a recovery (or differed between ranks)
shows as a digest that differs from the fault-free run's."""

from __future__ import annotations

import argparse
import datetime
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
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world >= 3, "the script wants 3 ranks or more"
    # made by every rank, in the same order, as torch requires
    sub = dist.new_group([0, 1])
    assert (sub == dist.GroupMember.NON_GROUP_MEMBER) == (rank not in (0, 1)), sub
    wide = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=10000))
    pairs = [[r for r in range(world) if r % 2 == p] for p in (0, 1)]
    pair, _ = dist.new_subgroups_by_enumeration(pairs)
    # split by every rank: the split this rank is in ([0, 2] or [1]), none left out
    halves = dist.split_group(split_ranks=[[2, 0], [1]])
    assert halves is not None and (halves.size() == 1) == (rank == 1), halves
    duo = None  # a split of a parent over some ranks: called by the parent's ranks only
    if rank in (0, 1):
        duo = dist.split_group(sub, split_ranks=[[0, 1]])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    loader = job.loader(DataLoader(ds, batch_size=8, sampler=sampler))
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    metrics = torch.zeros(args.steps, 4, dtype=torch.float64)
    job.track(metrics=TrackedTensor("metrics", metrics))  # a replacement must know the steps before it joined
    for step in job.steps(args.steps):
        with step:
            xb, yb = loader.batch(step.index)
            loss = F.mse_loss(model(xb), yb)
            # the metrics before backward: a peer that dies after its forward leaves this rank
            # waiting in a collective of the script's groups, not in the gradients' all-reduce
            mine = loss.detach().to(torch.float64)
            # the split groups first: a dead or raising rank 0 or 1 leaves its peers waiting there
            split = mine.clone()
            if duo is not None:
                dist.all_reduce(split, group=duo)
            halved = mine.clone()
            dist.all_reduce(halved, group=halves)
            first = mine.clone()
            if rank in (0, 1):
                dist.all_reduce(first, group=sub)  # ranks 0 and 1 only
            dist.broadcast(first, src=0, group=wide)  # to the others
            paired = mine.clone()
            dist.all_reduce(paired, group=pair)
            # each pair's sum once (from its lowest rank), summed over every rank
            total = paired if rank in (0, 1) else torch.zeros_like(paired)
            dist.all_reduce(total, group=wide)
            wide.monitored_barrier()  # what Lightning's prepare_data barrier calls
            metrics[step.index, 0] = first
            metrics[step.index, 1] = total
            # as the same values on every rank: the split of [0, 1]'s sum from rank 0, and each
            # half's sum once (from its lowest rank), summed
            dist.broadcast(split, src=0, group=wide)
            halves_total = halved if rank in (0, 1) else torch.zeros_like(halved)
            dist.all_reduce(halves_total, group=wide)
            metrics[step.index, 2] = split
            metrics[step.index, 3] = halves_total
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier(group=wide)
    if args.digest_out:
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in net.state_dict().values()))
        h.update(metrics.numpy().tobytes())
        with open(args.digest_out.replace("{rank}", str(rank)), "w") as f:
            f.write(h.hexdigest() + "\n")


if __name__ == "__main__":
    main()
