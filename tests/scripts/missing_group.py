"""A script whose ranks make different groups: rank 1 skips one ``dist.new_group`` (as a
framework might when its branch depends on the rank)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--digest-out", default="")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    job = cl.init()
    dist.new_group([0, 1])
    if dist.get_rank() != 1:
        dist.new_group([0, 1])  # rank 1 never makes this one
    job.track(model=net, optimizer=opt)
    for step in job.steps(args.steps):
        with step:
            t = torch.ones(1)
            dist.all_reduce(t)


if __name__ == "__main__":
    main()
