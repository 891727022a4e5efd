"""An unchanged torch DDP script: it knows nothing of checkpointless. It crashes once (rank 1,
first attempt) to show the plain launcher restarting the group, and prints which store torch got."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} store {os.environ.get('CHECKPOINTLESS_RENDEZVOUS', 'TCPStore')}", flush=True)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    if step == 3 and dist.get_rank() == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os._exit(3)
    loss = model(torch.ones(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
