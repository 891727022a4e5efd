"""An HSDP job for degraded mode's test (issue 39): FSDP2 over ``job.device_mesh`` on a (2, 2)
(replicate, shard) mesh, every micro-batch a function of (slot, step) alone, read through
``step.slot``, so a survivor that trains a lost replica's slot trains the batch that rank would
have. Records each step's batch (``job.record``), prints ``batch rank=SLOT step=S DIGEST`` for
every pass that ended cleanly, and writes each rank's final *shards'* digest to ``--digest-out``
(``{rank}`` filled in): replicas of a shard must agree, shards differ."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import checkpointless as cl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--data", default="")  # the job helpers pass one; this script makes its own
parser.add_argument("--digest-out", default="")
# a spare is ready only this many seconds after it starts (a host that comes back later), so
# that the job runs degraded for a while before it grows back
parser.add_argument("--spare-delay", type=float, default=0.0)
args = parser.parse_args()

if args.spare_delay and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
    time.sleep(args.spare_delay)

job = cl.init()
from torch.distributed.fsdp import fully_shard  # noqa: E402 - after init, as the example does

mesh = job.device_mesh(("replicate", "shard"), (2, 2))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
for layer in (model[0], model[2], model[4]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
job.track(model=model, optimizer=opt)


def micro_batch(slot: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


for step in job.steps(args.steps):
    with step:
        x, y = micro_batch(step.slot, step.index)
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        job.record(batch=digest)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(args.sleep)
    if step.passed:
        print(f"batch rank={step.slot} step={step.index} {digest}", flush=True)

if args.digest_out:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().numpy().tobytes())  # type: ignore[operator]
    with open(args.digest_out.replace("{rank}", str(job.rank)), "w") as f:
        f.write(h.hexdigest())
