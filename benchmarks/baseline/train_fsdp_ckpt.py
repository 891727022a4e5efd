"""Plain FSDP2 / HSDP under torchrun, with optional DCP sharded checkpoints: the sharded baseline.

The same GPT, data and seed as ``examples/train_gpt.py --fsdp R,S`` (model class, batch function
and shard digest are imported from it), sharded with torch's own ``fully_shard`` over
``init_device_mesh("cpu", (R, S), ("replicate", "shard"))`` on a plain gloo process group: no
launcher of ours, no resilient groups, no commit bookkeeping. Every ``--ckpt-every`` K steps the
FSDP2 state dict (each rank's own shards of model and AdamW state), the scheduler, the step and
each rank's RNG state are saved with ``torch.distributed.checkpoint.save``; a (re)started process
loads the newest complete checkpoint and redoes the steps after it. K = 0 never saves: the
steady-state baseline.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 \\
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29913 \\
        benchmarks/baseline/train_fsdp_ckpt.py --fsdp 2,2 --steps 40 --ckpt-every 10 \\
        --log-dir /tmp/f --inject kill:rank=1:step=25

Logs, fault injection, checkpoint discovery and the checkpoint/restart loop are ``ckptloop.py``'s,
shared with ``train_ddp_ckpt.py``, so benchmarks/recovery.py reads both the same way: ``phase`` events, one ``commit`` per step, ``save``
per checkpoint, ``fault``, ``done``. ``--digest-out`` may hold ``{rank}``: each rank then writes the
digest of its own shards.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptloop as cl  # noqa: E402  (imports torch.distributed.checkpoint: part of the import phase)

_T_IMPORTED = time.time()


def parse_mesh(text: str, world: int) -> tuple[int, int]:
    """``R,S`` with R * S equal to the world size, or exit naming the bad value."""
    try:
        r, s = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"bad --fsdp {text!r}: use R,S, e.g. 2,2 (HSDP) or 1,4 (FSDP)") from None
    if r < 1 or s < 1 or r * s != world:
        raise SystemExit(f"--fsdp {text}: R x S = {r * s}, but torchrun started {world} ranks")
    return r, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fsdp", required=True, metavar="R,S", help="(replicate, shard) mesh shape")
    cl.add_job_args(
        ap,
        hang_help="gloo timeout once the first step is done",
        digest_help="write the final shards' SHA-256 here; {rank}: one file per rank",
    )
    args = ap.parse_args()

    # checked before the rank's log is opened: a bad mesh leaves no log behind
    shape = parse_mesh(args.fsdp, int(os.environ.get("WORLD_SIZE", "1")))
    job = cl.start_job(args, _T_START, _T_IMPORTED)
    # one timeout for every group the mesh creates: a slow start must not look like a hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    job.log.phase("pg_ready")

    model = cl.build_model(job)
    for block in model.blocks:  # type: ignore[union-attr]  # the example GPT's transformer blocks
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    job.log.phase("model_ready")
    opt, sched = cl.make_optimizer(job, model)
    cl.train(job, model, opt, sched)  # its state dict is sharded: DCP writes each rank's own shards

    final = job.example.weights_digest(model)  # this rank's shards
    job.log.emit("done", digest=final)
    if args.digest_out and ("{rank}" in args.digest_out or job.rank == 0):
        job.example.write_digest(Path(args.digest_out.replace("{rank}", str(job.rank))), final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
