"""An adopted script with a planted fault-only divergence: input noise from a generator the
script owns and never gives to job.track(). Deterministic without faults; after a fault the
replacement's (or the retried step's) generator is not where the fault-free run's was, so
`checkpointless audit` must find the first divergent step of the faulted run."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    torch.manual_seed(0)
    xs = torch.randn(64, 16)
    ys = (xs[:, :8].sum(1) > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    job = cl.init()
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    noise = torch.Generator().manual_seed(1)  # the planted fault: state the job cannot see
    for step in job.steps(args.steps):
        with step:
            i = (step.index * 4 + job.rank * 2) % 64
            x = xs[i : i + 2] + 0.1 * torch.randn(2, 16, generator=noise)
            loss = F.cross_entropy(model(x), ys[i : i + 2])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
