"""A job that runs long enough to be interrupted from outside."""

from __future__ import annotations

import time

import torch

import checkpointless as cl

job = cl.init()
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(10_000):
    with step:
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
