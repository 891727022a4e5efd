"""Tensor parallel on a 2-D mesh with torch's own APIs: dp 2 x tp 2, adopted with checkpointless.

The mesh comes from ``init_device_mesh`` called directly after ``checkpointless.init()`` (its
groups are the job's resilient groups); a small MLP is split over "tp" with
``parallelize_module`` (``ColwiseParallel`` then ``RowwiseParallel``, after a replicated layer so
that forward and backward each have a TP all-reduce), and its two replicas over "dp" stay equal
because the script averages every gradient over the dp group, as DDP would. Each dp replica trains on its own batches, a pure function of (step, dp coordinate); the two tp ranks
of a replica see the same batch, as TP requires. With --fsdp the model is ``fully_shard``-ed over
"dp" after the TP split instead (FSDP2 x TP, torchtitan's order): every rank then holds a state
of its own, with no replica, and a lost rank's comes back from its buddy copy. With --hsdp S the
mesh has three dimensions (dp 2, shard S, tp 2) and FSDP2's HSDP over (dp, shard) keeps the
replicas: the state is named by its (shard, tp) coordinates. With --seq the model is a
transformer layer's TP shape (SeqNet) with SequenceParallel norms and loss parallel.

Each commit records where its step ran: the rank's TP group and its host (the network namespace:
one per host in tests/multihost/test_tp_host_netns.py).

--digest-out: each rank writes a hash of its own state (its parameters' local shards and its
AdamW state's local shards) to the path with "{rank}" filled in, so that every rank's shards can
be compared with the fault-free run's. The same script runs under plain torchrun (parity), and
with --torch-only it trains the same way with torch alone (the ground truth)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import checkpointless as cl


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of replica ``dp`` at ``step``: a pure function of both."""
    g = torch.Generator().manual_seed(step * 1000 + dp)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4].sin() + x[:, 4:8].cos()


class SeqNet(nn.Module):
    """--seq: a transformer layer's TP shape without attention: an embedding, a normed MLP with a
    residual, a norm and an output head over a vocabulary of 32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm2 = nn.LayerNorm(16)
        self.out = nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.down(F.relu(self.up(self.norm(h))))
        return self.out(self.norm2(h))  # type: ignore[no-any-return]


def seq_plan() -> dict[str, ParallelStyle]:
    """Sequence parallel between the TP blocks (the norms see a tp shard of the sequence), and
    the head's logits left sharded over the vocabulary for loss parallel, as torchtitan does."""
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def seq_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """--seq: 4 sequences of 8 tokens for replica ``dp`` at ``step``; the target is each token's
    predecessor."""
    g = torch.Generator().manual_seed(step * 1000 + dp)
    x = torch.randint(0, 32, (4, 8), generator=g)
    return x, torch.roll(x, 1, 1)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's shards of the parameters and of the optimizer state, bit for bit."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(local(p).detach().cpu().contiguous().numpy().tobytes())
        for i, s in sorted(opt.state_dict()["state"].items()):
            for k, v in sorted(s.items()):
                h.update(f"{i}.{k}".encode())
                h.update(local(v).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class TorchOnly:
    """--torch-only: the same training with torch alone (no checkpointless): the ground truth the
    adopted script must equal, bit for bit. Stands in for the few job calls the loop makes."""

    def __init__(self) -> None:
        cuda = torch.cuda.is_available()
        self.device = torch.device("cpu")
        if cuda:  # one rank per GPU, as the job does (LOCAL_RANK is torchrun's)
            self.device = torch.device(
                "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            )
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo")
        self.rank = dist.get_rank()

    def track(self, **objects: object) -> None:
        pass

    def record(self, **fields: object) -> None:
        pass

    def steps(self, total: int) -> Iterator[Step]:
        return (Step(i, self.rank) for i in range(total))


@dataclass
class Step:
    index: int
    slot: int  # the rank whose batch the pass trains: this process's own rank under torch alone

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--digest-out", required=True)
    ap.add_argument("--torch-only", action="store_true", help="train with torch alone (under torchrun)")
    ap.add_argument("--fsdp", action="store_true", help="fully_shard over dp (FSDP2 x TP), no replicas")
    ap.add_argument("--hsdp", type=int, default=0, metavar="S", help="3-D mesh (dp 2, shard S, tp 2), HSDP")
    ap.add_argument("--seq", action="store_true", help="SeqNet: SequenceParallel norms and loss parallel")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    # a spare is ready only this many seconds after it starts (a host that comes back later), so
    # that a job with no spare ready runs degraded for a while before it grows back
    ap.add_argument("--spare-delay", type=float, default=0.0)
    # each step lasts at least this long (a real step's device time): a degraded job must still
    # be running once its spares are ready, on a quiet machine too, or it never grows back
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args()
    if args.spare_delay and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
        time.sleep(args.spare_delay)

    torch.manual_seed(0)  # the same full model on every rank; each keeps its tp shard of it
    # a replicated layer first, so that the TP block's input needs a gradient: then backward
    # has a TP collective too (ColwiseParallel all-reduces its input's gradient over "tp")
    model: nn.Module = nn.Sequential(
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    if args.seq:
        model = SeqNet()
    job: Any = TorchOnly() if args.torch_only else cl.init()  # a hot spare waits in init()
    if args.hsdp:  # replicate x shard x tp, torchtitan's 3-D layout
        mesh = init_device_mesh(job.device.type, (2, args.hsdp, 2), mesh_dim_names=("dp", "shard", "tp"))
    else:
        mesh = init_device_mesh(job.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    # src_data_rank=None: each rank cuts its shard from its own (identical) copy. torch's
    # default (a scatter from tp rank 0 before the loop) works too and is covered by
    # tests/scripts/pre_loop.py; this script keeps the collective-free path covered
    plan = seq_plan() if args.seq else {"2": ColwiseParallel(), "4": RowwiseParallel()}
    parallelize_module(model.to(job.device), mesh["tp"], plan, src_data_rank=None)
    if args.fsdp or args.hsdp:  # TP first, then FSDP2 over the data-parallel dims (torchtitan)
        fully_shard(model, mesh=mesh["dp", "shard"] if args.hsdp else mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after parallelize_module: DTensor params
    job.track(model=model, optimizer=opt)
    dp_group = mesh["dp"].get_group()
    # where the step ran, in each commit: this rank's TP group and its host, the network
    # namespace (one per host in the many-host tests, tests/multihost/test_tp_host_netns.py)
    where = {
        "tp_group": dist.get_process_group_ranks(mesh["tp"].get_group()),
        "host": os.stat("/proc/self/ns/net").st_ino,
    }
    for step in job.steps(args.steps):
        time.sleep(args.step_sleep)
        with step:
            # every data-parallel coordinate ((dp) or (dp, shard)) takes a batch of its own and the
            # tp ranks of one share it: the slot's rank // TP, ranks being row-major with tp last.
            # From the step's slot, not the mesh: in degraded mode a pass trains a held slot's batch
            dp = step.slot // 2
            x, y = (seq_batch if args.seq else batch)(step.index, dp)
            job.record(batch=hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16], **where)
            # loss parallel: the cross-entropy of logits sharded over the vocabulary
            with loss_parallel() if args.seq else contextlib.nullcontext():
                out = model(x.to(job.device))
                if args.seq:
                    loss = F.cross_entropy(out.flatten(0, 1), y.to(job.device).flatten())
                else:
                    loss = F.mse_loss(out, y.to(job.device))
                opt.zero_grad()
                loss.backward()
            for p in [] if args.fsdp or args.hsdp else model.parameters():  # the replicas' average
                g = local(p.grad)
                dist.all_reduce(g, group=dp_group)
                g.div_(mesh["dp"].size())
            opt.step()
    Path(args.digest_out.format(rank=job.rank)).write_text(state_digest(model, opt))
    if args.torch_only:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
