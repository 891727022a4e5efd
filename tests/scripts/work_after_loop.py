"""A job whose ranks work long after their loop (a model saved slowly, an evaluation): they make
no step progress then, by design, and must not be judged hung. Each writes a file at the end."""

from __future__ import annotations

import sys
import time
from pathlib import Path

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
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
time.sleep(float(sys.argv[1]))  # past --hang-timeout
Path(sys.argv[2], f"saved-{job.rank}").write_text("ok")
