"""A small job that records an all-reduced loss before its backward, for the run-time replay check
(recovery/replay_check.py).

Each step's loss is all-reduced (``job.all_reduce``) and recorded (``job.record(loss=...)``)
right after the forward, so a rank lost in its backward leaves survivors that recorded the
interrupted attempt's loss, every rank's part of it included. ``--order time`` plants a
non-determinism: each process shuffles its data with a generator seeded from the time, so a
replacement trains other samples than the rank it replaces (what the check must report);
``--order fixed`` seeds it from the rank alone (a replay trains what the attempt trained).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from adopt import write_digest

import checkpointless as cl


class Net(torch.nn.Module):
    """Its first parameter is the output layer's, whose gradient backward produces first: the
    ``backward`` fault site (that parameter's gradient accumulated) fires before the gradients'
    all-reduce can have begun, so a rank killed there never lets its peer commit the step."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 2)
        self.body = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--order", choices=["time", "fixed"], default="fixed")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    xs = torch.randn(64, 16)
    ys = (xs[:, :8].sum(1) > 0).long()
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    job = cl.init()
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    seed = time.time_ns() if args.order == "time" else 1000 + job.rank  # the planted fault: the time
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
    for step in job.steps(args.steps):
        with step:
            i = (step.index % 16) * 4
            idx = order[i : i + 4]
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            mean = job.all_reduce(loss.detach().clone()) / job.world_size
            job.record(loss=mean.item())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    write_digest(args.digest_out, job.rank, net.state_dict())


if __name__ == "__main__":
    main()
