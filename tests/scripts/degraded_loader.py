"""A script written the README's way, for degraded mode's tests (issue 39): a DataLoader over a
map-style dataset with a DistributedSampler of this rank, made step-addressable with
``job.loader(...)``, the batch read as ``step.batch``, per-rank dropout from ``job.generator``.
With ``--tokens``: instead, a ``BatchLoader`` over the token file ``--data`` built for
``dp_rank=job.rank`` with a shared-memory cache, read as ``loader.batch(step.index)`` (the
examples/train_gpt.py way). Nothing in it knows about slots: a survivor that holds a lost rank's
slot gets that slot's batch and that rank's dropout stream from the job.

Prints ``batch rank=SLOT step=S DIGEST by=RANK`` for every pass that ended cleanly
(tests/helpers/jobs.py reads them; ``by`` is the process's own rank, to see who trained a held
slot) and writes each rank's final weights' digest to ``--digest-out`` (``{rank}`` filled in).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import checkpointless as cl
from checkpointless.data import BatchLoader, ShmBatchCache, TokenDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--sleep", type=float, default=0.02)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--tokens", action="store_true", help="a BatchLoader over the token file --data")
# per-rank seeds for torch's global generator and dropout drawn from it (recovery/slot_rng.py)
parser.add_argument("--global-dropout", action="store_true")
# a group of every rank made and never used in a step, as Lightning's prepare_data group is
parser.add_argument("--make-group", action="store_true")
# a collective of the script's own inside the step, which a degraded job refuses (ConfigError)
parser.add_argument("--metric", choices=["none", "job", "dist"], default="none")
# the batch picked by the script itself from a rank: `inside` reads job.rank inside the loop
# (the held slot in its pass), `before` reads dist.get_rank() once before it (trained twice:
# reported as inexact); either picks exactly the batches the DistributedSampler below would
parser.add_argument("--rank-batches", choices=["job", "inside", "before"], default="job")
parser.add_argument("--data", default="")  # the job helpers pass one; this script makes its own
parser.add_argument("--digest-out", default="")
# a spare that takes this long before it joins: the job runs degraded meanwhile
parser.add_argument("--spare-delay", type=float, default=0.0)
args = parser.parse_args()

if args.spare_delay and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
    time.sleep(args.spare_delay)


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is a pure function of i (as a file on disk would be)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, (x[:4].sum() > 0).long()


job = cl.init()
if args.make_group:
    dist.new_group(backend="gloo")
torch.manual_seed(0)
tokens: BatchLoader | None = None
if args.tokens:
    ds_tokens = TokenDataset.open(args.data)
    vocab = ds_tokens.vocab_size
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    cache = ShmBatchCache(job_id=job.job_id, rank=job.rank, capacity=4) if job.job_id else None
    tokens = BatchLoader(
        ds_tokens, seq_len=8, global_batch=8, seed=5, dp_rank=job.rank, dp_size=job.world_size, cache=cache
    )
else:
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    ds = Points()
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=7)
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=args.workers, drop_last=True)
    if args.rank_batches == "job":
        loader = job.loader(dl)
rank_before_loop = dist.get_rank()


def batch_of(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch the DistributedSampler above gives ``rank`` at step ``index`` (4 ranks, 6
    batches of 4 per epoch, the permutation of epoch e seeded 7 + e), picked by hand."""
    epoch, k = divmod(index, 6)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
    mine = order[rank :: job.world_size][k * 4 : (k + 1) * 4]
    xs, ys = zip(*(ds[i] for i in mine), strict=True)
    return torch.stack(xs), torch.stack(ys)


dp = job.data_parallel(model, bucket_cap_mb=0.001)  # a few buckets
if args.global_dropout:
    torch.manual_seed(1000 + job.rank)  # the model is built: from here on every rank draws its own
opt = torch.optim.Adam(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)

for step in job.steps(args.steps):
    with step:
        if tokens is not None:
            x, y = tokens.batch(step.index)
        elif args.rank_batches == "inside":
            x, y = batch_of(job.rank, step.index)
        elif args.rank_batches == "before":
            x, y = batch_of(rank_before_loop, step.index)
        else:
            x, y = step.batch
        out = dp(x)
        if tokens is not None:
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        mask = (torch.rand(out.shape, generator=job.generator("dropout", seed=3)) > 0.2).float() / 0.8
        if args.global_dropout:
            mask = F.dropout(mask, 0.1)  # from this rank's global generator
        opt.zero_grad()
        loss = F.cross_entropy(out * mask, y)
        loss.backward()
        if args.metric == "job":
            job.all_reduce(loss.detach().clone())
        elif args.metric == "dist":
            dist.all_reduce(loss.detach().clone())
        opt.step()
        time.sleep(args.sleep)
    if step.passed:
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes() + mask.numpy().tobytes())
        print(
            f"batch rank={step.slot} step={step.index} {digest.hexdigest()[:16]} by={dist.get_rank()}",
            flush=True,
        )

if tokens is not None:
    tokens.close()
if args.digest_out:
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    with open(args.digest_out.replace("{rank}", str(job.rank)), "w") as f:
        f.write(hashlib.sha256(weights).hexdigest())
