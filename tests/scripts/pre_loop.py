"""Collectives before the training loop, as scripts and frameworks run them, then tensor parallel
on the job's own mesh.

After ``checkpointless.init()`` and before ``job.steps()`` every rank runs:

1. ``dist.barrier()``;
2. Lightning's ``prepare_data`` barrier: a gloo group from ``dist.new_group`` with a timeout of
   10000 days, then ``dist.monitored_barrier`` on it;
3. a broadcast of rank 0's initial weights (each rank seeds its own model differently first, so
   without the broadcast the replicas would differ);
4. ``parallelize_module`` over ``job.device_mesh(("dp", "tp"), (1, 2))["tp"]`` with torch's default
   ``src_data_rank=0``: each shard is scattered from tp rank 0 (a collective per parameter). The
   model has a ``SequenceParallel`` norm, whose weight gradient is ``Partial``: the job all-reduces
   it before the update guard (recovery/script_mesh.settle_before_update), not inside AdamW's step.

--die-in-broadcast RANK: that rank SIGKILLs itself once (--marker) as its peers enter the
broadcast: a rank lost inside a collective before the loop. --digest-out: each rank writes a
hash of its own shards (parameters and AdamW state) to the path with "{rank}" filled in.
--torch-only trains the same way with torch alone under torchrun (the ground truth).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import checkpointless as cl


class Net(nn.Module):
    """A transformer block's TP shape without attention: sequence parallel around a normed MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.down(F.relu(self.up(self.norm(h))))
        return self.out(h)  # type: ignore[no-any-return]


PLAN = {
    "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
    "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch (the same on both tp ranks): 4 sequences of 6 tokens."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, 8, generator=g)
    return x, x[..., :4].sin()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(local(p).detach().contiguous().numpy().tobytes())
        for i, s in sorted(opt.state_dict()["state"].items()):
            for k, v in sorted(s.items()):
                h.update(f"{i}.{k}".encode())
                h.update(local(v).contiguous().numpy().tobytes())
    return h.hexdigest()


class TorchOnly:
    """--torch-only: torch alone, under torchrun; stands in for the job calls the script makes."""

    def __init__(self) -> None:
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def device_mesh(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", shape, mesh_dim_names=names)

    def track(self, **objects: object) -> None:
        pass

    def steps(self, total: int) -> Iterator[Any]:
        from contextlib import nullcontext

        for i in range(total):
            step: Any = nullcontext()
            step.index = i
            yield step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--digest-out", required=True)
    ap.add_argument("--torch-only", action="store_true")
    ap.add_argument("--die-in-broadcast", type=int, default=-1)
    ap.add_argument("--marker")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    job: Any = TorchOnly() if args.torch_only else cl.init()  # a hot spare waits in init()
    rank = dist.get_rank()
    dist.barrier()
    # Lightning's _InfiniteBarrier around prepare_data
    lightning_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=10000))
    dist.monitored_barrier(group=lightning_group, timeout=datetime.timedelta(days=10000))

    torch.manual_seed(100 + rank)  # a different model on every rank: the broadcast makes them one
    model = Net()
    if rank == args.die_in_broadcast and args.marker and not Path(args.marker).exists():
        Path(args.marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    mesh = job.device_mesh(("dp", "tp"), (1, 2))
    parallelize_module(model, mesh["tp"], PLAN)  # src_data_rank=0: scattered from tp rank 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job.track(model=model, optimizer=opt)
    for step in job.steps(args.steps):
        with step:
            x, y = batch(step.index)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    Path(args.digest_out.format(rank=rank)).write_text(state_digest(model, opt))
    if args.torch_only:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
