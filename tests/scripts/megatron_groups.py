"""Megatron-Core's own groups under the job (issue 37): ``parallel_state.initialize_model_parallel``
called as a Megatron training script calls it, after ``checkpointless.init()``, makes every group
Megatron uses (tensor, pipeline, data, context, expert, embedding, model-parallel, and the gloo
twins of the data-parallel ones) with ``dist.new_group``, which the job's default group is handed
(comm/script_groups.py).

The model is a small MLP replicated on every rank and averaged over the world (``job.data_parallel``),
so that a lost rank's state has a copy; each step also reduces the loss over each of Megatron's
groups, sums those over the world (so that every rank keeps the same numbers) and keeps them,
and they go into ``--digest-out`` with the final weights: a group that
re-formed wrong after a recovery (another membership, a stale communicator, a rank's part twice)
shows as a digest that differs from the fault-free run's.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from torch import nn
from tracked_tensor import TrackedTensor

import checkpointless as cl

GROUPS = [  # Megatron's getters, in the order the sums are kept
    "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_context_parallel_group",
    "get_model_parallel_group",
    "get_embedding_group",
    "get_tensor_and_data_parallel_group",
    "get_expert_model_parallel_group",
    "get_expert_data_parallel_group",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--digest-out", default="")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args = ap.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    job = cl.init()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    groups = [getattr(ps, name)() for name in GROUPS]
    model = job.data_parallel(net)
    job.track(model=net, optimizer=opt)
    sums = torch.zeros(args.steps, len(GROUPS), dtype=torch.float64)
    job.track(sums=TrackedTensor("sums", sums))  # a replacement must know the steps before it joined
    for step in job.steps(args.steps):
        with step:
            g = torch.Generator().manual_seed(1000 * step.index + job.rank)
            x = torch.randn(4, 8, generator=g)
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            mine = torch.zeros(len(GROUPS), dtype=torch.float64)
            for i, group in enumerate(groups):  # before backward: a dead peer leaves us in one of these
                t = loss.detach().to(torch.float64)
                dist.all_reduce(t, group=group)
                mine[i] = t
            # each rank's sums differ (its own groups'); their sum over the world is what every
            # rank keeps, so that the kept tensor is the replica's state like the weights
            dist.all_reduce(mine)
            sums[step.index] = mine
            opt.zero_grad()
            loss.backward()
            opt.step()
    if args.digest_out:
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in net.state_dict().values()))
        h.update(sums.numpy().tobytes())
        with open(args.digest_out.replace("{rank}", str(job.rank)), "w") as f:
            f.write(h.hexdigest() + "\n")


if __name__ == "__main__":
    main()
