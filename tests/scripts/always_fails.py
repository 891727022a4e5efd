"""A script with a real bug: step 3 raises every time. Recovery must not loop for ever."""

from __future__ import annotations

import torch

import checkpointless as cl

job = cl.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(6):
    with step:
        if step.index == 3 and job.rank == 1:
            raise ZeroDivisionError("a bug in the training step")
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
