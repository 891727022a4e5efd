"""An adopted script with a planted non-determinism: each epoch's data order comes from a
generator seeded with the time, so no two runs train on the same batches (what
`checkpointless audit` must find and name)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    torch.manual_seed(0)
    xs = torch.randn(args.samples, 16)
    ys = (xs[:, :8].sum(1) > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    job = cl.init()
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    # the planted fault: the shuffle's seed is the time, not a function of the step
    order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(time.time_ns()))
    per_epoch = args.samples // args.batch
    for step in job.steps(args.steps):
        with step:
            i = (step.index % per_epoch) * args.batch
            idx = order[i : i + args.batch]
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
