"""A script that forgot ``with step:`` around its loop body: the job must stop with an error
that says so, not train on outside the job (nothing would commit)."""

from __future__ import annotations

import torch

import checkpointless as cl

job = cl.init()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for _step in job.steps(5):  # the mistake: no `with _step:`
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
