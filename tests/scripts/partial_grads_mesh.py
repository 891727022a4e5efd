"""A tensor-parallel model on the job's own mesh (``job.device_mesh``), run plainly (a world of
one): its ``SequenceParallel`` norm's weight gradient is ``Partial`` after backward. Prints, as
JSON, the placements of that gradient that a step pre-hook registered before ``job.track()``
sees: the job settles the gradient before every other pre-hook (the update guard's included)."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

import checkpointless as cl


def main() -> None:
    job = cl.init()
    mesh = job.device_mesh(("tp",), (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    after_backward: list[str] = []
    seen: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(str(model[0].weight.grad.placements)))
    job.track(model=model, optimizer=opt)
    for step in job.steps(2):
        with step:
            x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(step.index))
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            after_backward.append(str(model[0].weight.grad.placements))
            opt.step()
    print(json.dumps({"after_backward": after_backward, "seen_by_pre_hooks": seen}))


if __name__ == "__main__":
    main()
