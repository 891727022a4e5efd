"""A data-parallel job for degraded mode's tests (issue 39): every micro-batch is a function of
(slot, step) alone, read through ``step.slot``, so a survivor that trains a lost rank's slot
trains the batch that rank would have. Prints ``batch rank=SLOT step=S DIGEST`` for every pass
that ended cleanly (tests/helpers/jobs.py reads them) and writes each rank's final weights'
digest to ``--digest-out`` (``{rank}`` filled in)."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F

import checkpointless as cl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--sleep", type=float, default=0.02)
parser.add_argument("--data", default="")  # the job helpers pass one; this script makes its own
parser.add_argument("--digest-out", default="")
# a spare that never becomes ready (a host that never comes), for --min-replicas
parser.add_argument("--spares-never-ready", action="store_true")
args = parser.parse_args()

if args.spares_never_ready and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
    time.sleep(3600)  # the launcher kills it with the job

job = cl.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
dp = job.data_parallel(model, bucket_cap_mb=0.001)  # a few buckets
opt = torch.optim.Adam(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)


def micro_batch(slot: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


for step in job.steps(args.steps):
    with step:
        x, y = micro_batch(step.slot, step.index)
        opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        time.sleep(args.sleep)
    if step.passed:
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        print(f"batch rank={step.slot} step={step.index} {digest}", flush=True)

if args.digest_out:
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    with open(args.digest_out.replace("{rank}", str(job.rank)), "w") as f:
        f.write(hashlib.sha256(weights).hexdigest())
