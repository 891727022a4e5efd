"""Pipeline parallel on a 2-D mesh with torch's own APIs: dp 2 x pp 2, adopted with checkpointless.

The mesh comes from ``init_device_mesh`` called directly after ``checkpointless.init()`` (its
groups are the job's resilient groups). A small MLP, built whole from one seed on every rank, is
cut in two stages: rank (dp=i, pp=j) keeps stage j's layers, wraps them in a
``torch.distributed.pipelining.PipelineStage`` on the "pp" group and runs them with
``ScheduleGPipe`` (or ``Schedule1F1B`` with --schedule 1f1b) over 4 microbatches: activations
and their gradients travel between the stages by point-to-point sends and receives. With
--schedule interleaved a deeper MLP is cut in four stages, two per rank (pp 0 holds stages 0
and 2, pp 1 stages 1 and 3), run by ``ScheduleInterleaved1F1B``. The two
replicas over "dp" stay equal because the script averages every gradient over the dp group, as
DDP would. Replica ``dp`` trains on its own batches, a pure function of (step, dp coordinate);
both stages of a replica see the same batch (stage 0 its inputs, stage 1 its targets).

--digest-out: each rank writes a hash of its own state (its stage's parameters and AdamW state)
to the path with "{rank}" filled in, so that every rank's state can be compared with the
fault-free run's. The same script runs under plain torchrun (parity), and with --torch-only it
trains the same way with torch alone (the ground truth)."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import checkpointless as cl

MICROBATCHES = 4


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of replica ``dp`` at ``step``: a pure function of both."""
    g = torch.Generator().manual_seed(step * 1000 + dp)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4].sin() + x[:, 4:8].cos()


def stage_module(pp: int, hidden: int = 32) -> nn.Module:
    """Stage ``pp``'s layers of one MLP built whole from seed 0 (the same on every rank)."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 4)]
    return nn.Sequential(*(layers[:2] if pp == 0 else layers[2:]))


def chunks(pp: int, pp_size: int) -> nn.ModuleList:
    """--schedule interleaved: a deeper MLP (seed 0) in 2 x pp_size stages, of which rank ``pp``
    holds stages ``pp`` and ``pp + pp_size`` (torch's loop placement)."""
    torch.manual_seed(0)
    dims = [16, 32, 32, 32, 4]
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(a, b), nn.Tanh()) if i < 3 else nn.Linear(a, b)
        for i, (a, b) in enumerate(itertools.pairwise(dims))
    ]
    return nn.ModuleList([blocks[pp], blocks[pp + pp_size]])


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's stage parameters and optimizer state, bit for bit."""
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
        self.device = torch.device("cpu")
        if torch.cuda.is_available():  # one rank per GPU (LOCAL_RANK is torchrun's)
            self.device = torch.device(
                "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            )
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank = dist.get_rank()

    def track(self, **objects: object) -> None:
        pass

    def record(self, **fields: object) -> None:
        pass

    def steps(self, total: int) -> Iterator[Step]:
        return (Step(i) for i in range(total))


@dataclass
class Step:
    index: int

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--digest-out", required=True)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="gpipe")
    ap.add_argument("--torch-only", action="store_true", help="train with torch alone (under torchrun)")
    ap.add_argument("--tp", action="store_true", help="dp 2 x pp 2 x tp 2: each stage tensor-parallel")
    ap.add_argument(
        "--hidden", type=int, default=32, help="width of the MLP's hidden layers (not --schedule interleaved)"
    )
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    job: Any = TorchOnly() if args.torch_only else cl.init()  # a hot spare waits in init()
    if args.tp:  # 8 ranks: rank r is (dp r // 4, pp r // 2 % 2, tp r % 2)
        mesh = init_device_mesh(job.device.type, (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh(job.device.type, (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    pp_group = mesh["pp"].get_group()
    schedule: Any
    model: nn.Module
    if args.schedule == "interleaved":  # two stages per rank: 0 and 2 on pp 0, 1 and 3 on pp 1
        model = chunks(pp, 2).to(job.device)
        stages = [PipelineStage(m, pp + 2 * i, 4, job.device, group=pp_group) for i, m in enumerate(model)]
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    else:
        model = stage_module(pp, args.hidden).to(job.device)
        if args.tp:  # the activations between the stages stay whole (Replicate)
            tp_plan = {"0": ColwiseParallel(output_layouts=Replicate())}
            if pp == 1:
                tp_plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], tp_plan, src_data_rank=None)  # type: ignore[arg-type]
        stage = PipelineStage(model, pp, 2, job.device, group=pp_group)
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = kind(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the modules the stages run (their forward is what the stages call; a ModuleList's is not),
    # and the schedule, which names the pipeline group
    modules = (
        {f"stage{i}": m for i, m in enumerate(model)}
        if isinstance(model, nn.ModuleList)
        else {"model": model}
    )
    job.track(**modules, optimizer=opt, schedule=schedule)
    # the dp group and its size, looked up once: ``mesh["dp"]`` builds a sub-mesh at every call
    # (about 0.5 ms of CPU on torch 2.13, once per parameter per step), a cost the torchrun
    # baseline (benchmarks/baseline/train_pp_ckpt.py) never paid: the step-time comparison
    # charged it to checkpointless
    dp_group, dp_size = mesh["dp"].get_group(), mesh["dp"].size()
    for step in job.steps(args.steps):
        with step:
            x, y = batch(step.index, dp)
            job.record(batch=hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16])
            opt.zero_grad()
            if pp == 0:
                schedule.step(x.to(job.device))
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=y.to(job.device), losses=losses)
            for p in model.parameters():  # the replicas' average
                assert p.grad is not None
                g = local(p.grad)
                dist.all_reduce(g, group=dp_group)
                g.div_(dp_size)
            opt.step()
    Path(args.digest_out.format(rank=job.rank)).write_text(state_digest(model, opt))
    if args.torch_only:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
