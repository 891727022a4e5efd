"""An adopted FSDP2 script that saves and restores its own checkpoint, one file per rank holding
that rank's local shards (as a script that writes per-rank files does), and resumes with
``job.steps(total, start=saved_step)``.

--save DIR: after the last step each rank writes DIR/rank<r>.pt (its shards and the step).
--resume DIR: each rank that is not a replacement restores its file before job.steps() and
appends its rank to --load-log.
--die-at-start RANK: that rank SIGKILLs itself once (--marker), after restoring and before
job.steps(): a rank lost during start-up, whose place a spare takes before the job's first
state sync. With R = 1 nobody else holds its shard, so the spare must restore it itself.
--digest-out: each rank writes a hash of its own shards to the path with "{rank}" filled in.

SGD without momentum keeps the optimizer stateless, so the parameters are the whole state.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="2,2", help="R,S")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save")
    ap.add_argument("--resume")
    ap.add_argument("--load-log")
    ap.add_argument("--die-at-start", type=int, default=-1)
    ap.add_argument("--marker")
    ap.add_argument("--digest-out", required=True)
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    job = cl.init()
    shape = tuple(int(n) for n in args.mesh.split(","))
    mesh = job.device_mesh(("replicate", "shard"), shape)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    job.track(model=model, optimizer=opt)

    start = 0
    if args.resume and not job.is_replacement:  # a replacement receives its shard from a peer
        saved = torch.load(Path(args.resume) / f"rank{job.rank}.pt")
        with torch.no_grad():
            for p, t in zip(model.parameters(), saved["params"], strict=True):
                p.to_local().copy_(t)
        start = int(saved["step"])
        with open(args.load_log, "a") as f:
            f.write(f"{job.rank}\n")
    if job.rank == args.die_at_start and args.marker and not Path(args.marker).exists():
        Path(args.marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)

    for step in job.steps(args.steps, start=start):
        with step:
            x = torch.linspace(-1, 1, 32).reshape(4, 8) * (step.index + 1) + job.rank
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    local = [p.detach().to_local().clone() for p in model.parameters()]
    if args.save:
        torch.save({"step": args.steps, "params": local}, Path(args.save) / f"rank{job.rank}.pt")
    h = hashlib.sha256()
    for t in local:
        h.update(t.contiguous().numpy().tobytes())
    Path(args.digest_out.format(rank=job.rank)).write_text(h.hexdigest())


if __name__ == "__main__":
    main()
