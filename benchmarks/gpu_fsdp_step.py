"""One FSDP2 training run on one device, over torch's own process groups or over ours, timed.

``benchmarks/gpu_check.py`` runs this alternately with ``--groups plain`` (``init_process_group``
with NCCL on a GPU, gloo on a CPU, and ``init_device_mesh``) and ``--groups ours``
(``make_device_mesh``: :class:`ResilientProcessGroup` s whose generation forms an NCCL group for
CUDA tensors) on the same model, data and seed, and the final weights must be bitwise equal.

A world of one, since one GPU is what a lease gives: FSDP2 then sends no all-gather or
reduce-scatter at all (it copies locally when the shard group has one member), so the mesh is
2-D, ``("replicate", "shard")`` of ``(1, 1)``, and HSDP's all-reduce of each block's gradients is
what goes through the groups: one synchronous NCCL all-reduce per block per step (counted for
ours, and required to be above 0). The ratio is what our groups' dispatch costs those
all-reduces; it says nothing of collectives that move bytes between GPUs.

    python3 benchmarks/gpu_fsdp_step.py --groups ours --device cuda --out run.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", choices=("plain", "ours"), required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096, help="rows of the input batch")
    ap.add_argument("--steps", type=int, default=60, help="timed steps, after the warm-up")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", help="write the result here as JSON")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: fixed GEMMs
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpointless.comm.mesh import make_device_mesh

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    store = dist.HashStore()
    names = ("replicate", "shard")
    issued: list[str] = []  # collectives through our groups (torch's own groups are not counted)
    if a.groups == "plain":
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
        mesh = init_device_mesh(a.device, (1, 1), mesh_dim_names=names)
    else:
        rm = make_device_mesh(names, (1, 1), 0, 1, store, device_type=a.device)
        rm.configure(0, store, time.monotonic() + 60)
        for pg in rm.dim_groups:
            pg.before_collective = issued.append
        mesh = rm.device_mesh

    torch.manual_seed(3)
    blocks = [
        nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))
        for _ in range(a.layers)
    ]
    model = nn.Sequential(*blocks).to(a.device)
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=a.device).manual_seed(4)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    issued_before_timing = 0
    step_ms: list[float] = []
    cpu_ms: list[float] = []
    for step in range(a.warmup + a.steps):
        x = torch.randn(a.rows, a.dim, device=a.device, generator=gen)
        if step == a.warmup:
            issued_before_timing = len(issued)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sync()
        if step >= a.warmup:
            step_ms.append((time.perf_counter() - t0) * 1e3)
            cpu_ms.append((time.process_time() - c0) * 1e3)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # type: ignore[operator]
    out: dict[str, object] = {
        "groups": a.groups,
        "device": a.device,
        "group_type": type(mesh.get_group("replicate")).__name__,
        "collectives_per_step": (len(issued) - issued_before_timing) / a.steps
        if a.groups == "ours"
        else None,
        "step_ms_median": statistics.median(step_ms),
        "cpu_ms_median": statistics.median(cpu_ms),
        "step_ms": [round(v, 3) for v in step_ms],
        "digest": h.hexdigest(),
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out))
    print(json.dumps({k: v for k, v in out.items() if k != "step_ms"}), flush=True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
