"""An unchanged torch FSDP2 script: torch's own device mesh (whose groups c10d makes with
``new_group`` over the store init_process_group got) and ``fully_shard``. Rank 1 crashes once
(first attempt) so the plain launcher restarts the group; each rank prints its shard's sum."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    if step == 1 and dist.get_rank() == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os._exit(3)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
total = sum(float(p.detach().to_local().sum()) for p in model.parameters())
# one write per line: the two ranks share the launcher's stdout
leader = os.getsid(0) == os.getpid()  # a session of its own, as under torchrun
os.write(1, f"rank {dist.get_rank()} session-leader {leader} done shard sum {total:.6f}\n".encode())
dist.destroy_process_group()
