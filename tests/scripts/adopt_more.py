"""adopt.py's model and data, plus: a protected evaluation (job.section), a resume from the
script's own checkpoint (job.steps(start=)), step.epoch, and a one-off silent corruption of one
rank's weights for the divergence check to catch.

Both the evaluation and the training step draw from torch's global generator (the evaluation
samples which items count, the step adds noise to its inputs), so an evaluation redone after a
fault must start from the generator as the first attempt did, or every later step differs.

Commit events carry the batch digest and the epoch; every completed evaluation emits a section
event with the digests of the evaluation batches it saw; every rank writes its final weights'
SHA-256.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from adopt import Points, digest, write_digest
from torch.utils.data import DataLoader, DistributedSampler

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--kill-in-eval", type=int, default=-1, help="rank 1 SIGKILLs itself in this eval")
    ap.add_argument("--raise-in-eval", type=int, default=-1, help="rank 0 raises once in this eval")
    ap.add_argument("--perturb-step", type=int, default=-1, help="rank 1 flips a weight bit here")
    ap.add_argument("--save", help="rank 0 saves model+optimizer+step here at the end")
    ap.add_argument("--resume", help="load this checkpoint and start at its step")
    ap.add_argument("--load-log", help="every process that loads the checkpoint appends a line")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    job = cl.init()

    ds = Points(64)
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=7)
    loader = job.loader(DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True))
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)

    eval_ds = Points(1000 + 6 * job.world_size)  # the last 6 per rank are the evaluation set
    raised = []

    def evaluate() -> None:
        at = job.committed_step
        net.eval()
        seen, total = [], torch.zeros(1)
        with torch.no_grad():
            for i in range(6):
                x, y = eval_ds[1000 + job.rank * 6 + i]
                if i == 3 and at == args.kill_in_eval and job.rank == 1 and not job.is_replacement:
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death in the middle of evaluation
                if i == 2 and at == args.raise_in_eval and job.rank == 0 and not raised:
                    raised.append(1)
                    raise RuntimeError("evaluation failed once")
                if torch.rand(()) < 0.8:  # a sampled evaluation: about 4 of 5 items count
                    total += F.cross_entropy(model(x[None]), y[None])
                    seen.append(digest(x, y))
        job.all_reduce(total)  # a collective outside any step
        net.train()
        job.record(eval=seen, eval_loss=float(total))

    job.section("eval", evaluate, every=args.eval_every)
    start = 0
    if args.resume and not job.is_replacement:  # a replacement receives the state from a peer
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])  # the steps draw from it: an exact resume needs it
        start = int(ckpt["step"])
        if args.load_log:
            with open(args.load_log, "a") as f:
                f.write(f"{job.rank} {os.getpid()}\n")

    for step in job.steps(args.steps, start=start):
        with step:
            x, y = loader.batch(step.index)
            job.record(batch=digest(x, y), epoch=step.epoch, in_epoch=step.index_in_epoch)
            loss = F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step.index == args.perturb_step and job.rank == 1 and not job.is_replacement:
                with torch.no_grad():  # a silent bug: one rank's weights drift, nothing raises
                    net[0].weight.view(-1)[0] += 1e-3

    if args.save and job.rank == 0:
        state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": job.committed_step}
        torch.save({**state, "rng": torch.get_rng_state()}, args.save)
    write_digest(args.digest_out, job.rank, net.state_dict())


if __name__ == "__main__":
    main()
