"""One rank of a 2x2 HSDP job (FSDP2 over job-style resilient groups, gloo, CPU), run at full width
and then as degraded HSDP would run it after losing replica group 1 (issue 39).

Full: rank r trains the micro-batch of (slot r, step) on the (replicate, shard) mesh.
Degraded: the replicate groups are folded (comm/folded.py); ranks 0 and 1 (replica 0)
each train two passes per step, their own slot's micro-batch and then slot r + 2's (the same shard
coordinate in the lost group), with ``hold_replica_reduce`` keeping the first pass's
reduce-scattered gradient for the second pass's all-reduce; ranks 2 and 3 train nothing. A third
model in degraded mode trains its own batch twice (the mistake a held pass must not make), so the
test can check that its comparison sees a wrong batch.

Writes ``{mode: {"model": digest}}`` of this rank's final shards (and optimizer state) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from checkpointless.comm.mesh import hold_replica_reduce, make_device_mesh

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

WORLD, SHARDS = 4, 2


def batch(slot: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + slot)
    return torch.randn(8, 16, generator=g), torch.randint(0, 6, (8,), generator=g)


def make_model(mesh: Any, param_dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 6)
    )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, passes: list[int], degraded: bool) -> None:
    for step in range(args.steps):
        for i, slot in enumerate(passes):
            last = i == len(passes) - 1
            if degraded:
                hold_replica_reduce(model, last)
            opt.zero_grad(set_to_none=True)  # as a script does in every pass
            x, y = batch(slot, step)
            F.cross_entropy(model(x).float(), y).backward()
            if last:
                opt.step()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().float().numpy().tobytes())  # type: ignore[operator]
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                h.update(t.detach().float().reshape(-1).numpy().tobytes())
    return h.hexdigest()


store = dist.TCPStore("127.0.0.1", args.port, WORLD, is_master=args.rank == 0, timeout=datetime.timedelta(60))
results: dict[str, dict[str, str]] = {}
# one set of processes runs both jobs, each on a mesh of its own (generation 0, then 1): a
# process start costs far more than these steps
for generation, mode in enumerate(["full", "degraded"]):
    rmesh = make_device_mesh(("replicate", "shard"), (2, SHARDS), args.rank, WORLD, store)
    rmesh.fold_replicas(mode == "degraded")
    rmesh.configure(generation, store, time.monotonic() + 60)
    own = [args.rank]
    if mode == "degraded":
        # replica 0 holds replica 1's slots of its shard coordinates; replica 1 has left
        own = [args.rank, args.rank + SHARDS] if args.rank < SHARDS else []
    out: dict[str, str] = {}
    for name, dtype, passes in [
        ("fp32", torch.float32, own),
        ("bf16", torch.bfloat16, own),
        ("own_twice", torch.float32, [args.rank, args.rank] if own else []),
    ]:
        if mode == "full" and name == "own_twice":
            continue
        model, opt = make_model(rmesh.device_mesh, dtype)
        if passes:
            train(model, opt, passes, mode == "degraded")
            out[name] = digest(model, opt)
    if mode == "degraded":
        # a collective over the folded group other than FSDP2's all-reduce is refused, not
        # answered with this process's part alone: the script's own all-reduce too
        folded = rmesh.dim_groups[0]
        for what in ("barrier", "all_reduce"):
            try:
                if what == "barrier":
                    dist.barrier(group=folded)
                else:
                    dist.all_reduce(torch.ones(2), group=folded)
                out[what] = "answered"
            except Exception as e:  # the refusal's type is checked by the test
                out[what] = type(e).__name__
    dist.barrier(group=rmesh.world)  # the world group still spans all four processes
    results[mode] = out
with open(args.out, "w") as f:
    json.dump(results, f)
    f.flush()
os._exit(0)  # gloo's teardown of the parked groups takes seconds and checks nothing
