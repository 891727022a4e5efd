"""A job that commits a small step every ~20 ms for as long as it is left to run (stopped with a
signal): the metrics flood tests watch its commits while /metrics is hammered."""

from __future__ import annotations

import time

import torch

import checkpointless as cl

job = cl.init()
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)
for step in job.steps(1_000_000):
    with step:
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.02)
