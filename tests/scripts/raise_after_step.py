"""A script whose error escapes the loop between two steps (outside ``with step``): on every
rank, after step 3 committed. It must not count as a clean ``break``: the job fails."""

from __future__ import annotations

import sys

import torch

import checkpointless as cl

job = cl.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(8):
    with step:
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if step.index == 3:
        if "--exit" in sys.argv:
            sys.exit(3)
        raise RuntimeError("an evaluation bug between two steps")
