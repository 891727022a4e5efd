"""The workers start fine, but a replacement cannot: whatever it needs after init() is broken
for it (as with a cache directory that another user pre-created). The launcher must give up
after a few tries and say why, not respawn for ever."""

from __future__ import annotations

import os
import time

import torch

import checkpointless as cl

job = cl.init()
if os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
    raise PermissionError("cannot open /dev/shm/example-cache: owned by another user")
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
