"""A script written the way users write one: a DataLoader with workers over a map-style dataset
and a DistributedSampler, optionally AMP with a GradScaler, per-rank dropout, an early break.

Every commit event carries the batch's digest (and the dropout mask's), and every rank writes its
final weights' SHA-256, so a faulted run can be compared with a fault-free one bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import checkpointless as cl


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is a pure function of i (as a file on disk would be)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        return x, (x[:8].sum() > 0).long()


class NoisyPoints(Points):
    """Points with random augmentation drawn from torch's global generator in ``__getitem__``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return x + 0.05 * torch.randn(16), y


def write_digest(pattern: str, rank: int, state: dict[str, torch.Tensor], extra: bytes = b"") -> None:
    """Write the SHA-256 of ``state`` (by name) and ``extra`` to ``pattern`` with "{rank}" filled
    in, atomically: a test never reads half a digest."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode() + t.contiguous().numpy().tobytes())
    h.update(extra)
    path = Path(pattern.replace("{rank}", str(rank)))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(h.hexdigest() + "\n")
    os.replace(tmp, path)


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--amp", choices=["none", "bfloat16", "float16"], default="none")
    ap.add_argument("--clip", action="store_true", help="scaler.unscale_() + clip_grad_norm_")
    ap.add_argument("--rank-dropout", action="store_true", help="per-rank masks from job.generator")
    ap.add_argument("--break-after", type=int, default=-1, help="break after this step commits")
    ap.add_argument("--stop-at", type=int, default=-1, help="call job.stop() in this step")
    ap.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader")
    ap.add_argument(
        "--augment", action="store_true", help="augmentation and dropout from torch's global generator"
    )
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.amp)
    # a small initial scale: with float16 the default 65536 overflows at once and skips steps
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3, enabled=dtype is not None)

    job = cl.init()
    # what torchrun-style code reads must be there, in a replacement too
    want = {"RANK": job.rank, "LOCAL_RANK": job.rank, "WORLD_SIZE": job.world_size}
    want["LOCAL_WORLD_SIZE"] = job.world_size
    for name, value in want.items():
        assert os.environ[name] == str(value), (name, os.environ.get(name), value)

    ds = NoisyPoints(args.samples) if args.augment else Points(args.samples)
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=7)
    loader_type = DataLoader
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as loader_type
    dl = loader_type(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, drop_last=True)
    loader = job.loader(dl)
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt, scaler=scaler)

    for step in job.steps(args.steps):
        with step:
            x, y = loader.batch(step.index)
            job.record(batch=digest(x, y), epoch=step.epoch)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            if args.rank_dropout:
                # different on every rank, the same on every run of this (rank, step)
                g = job.generator("dropout", seed=11)
                mask = (torch.rand(out.shape, generator=g) > 0.3).to(out.dtype) / 0.7
                job.record(mask=digest(mask))
                out = out * mask
            if args.augment:
                out = F.dropout(out, 0.2)  # draws after the batch's augmentation did
            loss = F.cross_entropy(out.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip:  # the clipping idiom: unscale_ by hand, then scaler.step() must not again
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if step.index == args.stop_at:
                job.stop()
        if step.committed and step.index == args.break_after:
            break

    if job.job_id is not None and job.rank == 0:
        # for the test's leftover check: the job's private /dev/shm name (other jobs may run too)
        from checkpointless.config import job_shm_name

        Path(args.digest_out.replace("{rank}", "shm")).write_text(job_shm_name(job.job_id))
    write_digest(args.digest_out, job.rank, net.state_dict())


if __name__ == "__main__":
    main()
