"""A bug that moves with the steps: rank 1 raises on the first attempt of every step from step 3
on (a replay then succeeds). No single step fails often, so only the fault budget can stop it."""

from __future__ import annotations

import torch

import checkpointless as cl

job = cl.init()
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
tried: set[int] = set()
for step in job.steps(40):
    with step:
        if job.rank == 1 and step.index >= 3 and step.index not in tried:
            tried.add(step.index)
            raise RuntimeError(f"bad input row in batch {step.index}")
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
