"""The traditional way to survive a fault, tuned: torchrun restarts plus periodic DCP checkpoints.

The same GPT, data and seed as ``examples/train_gpt.py`` (model class, batch function and weight
digest are imported from it, so the two can never drift apart), trained with plain gloo
``DistributedDataParallel(find_unused_parameters=True)`` (fixed gradient buckets, so a restart is
bitwise reproducible; see shared/REFERENCES.md). Every ``--ckpt-every`` steps the model, optimizer,
scheduler, step counter and each rank's RNG state are saved with ``torch.distributed.checkpoint``;
a (re)started process loads the newest complete checkpoint and resumes at its step. Batches are a
pure function of (seed, step, rank), so the data resumes exactly.

Run under torchrun (4 ranks, 3 restarts)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 \\
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29911 \\
        benchmarks/baseline/train_ddp_ckpt.py --steps 35 --ckpt-every 10 --log-dir /tmp/b \\
        --inject kill:rank=1:step=25

Faults (``--inject KIND:rank=R:step=S``, repeatable; KIND raise, kill, hang or node) fire as the rank
begins step S, once per job (a marker file in --log-dir remembers it across restarts). ``hang``
stops the process with SIGSTOP: the survivors then wait in their all-reduce until the gloo timeout
(``--hang-timeout``, applied once the first step after each start has completed, so a slow start
is not mistaken for a hang) fails them and torchrun restarts everyone. ``node`` SIGKILLs the
rank's torchrun agent with it: a whole node lost, which an elastic job (``--nnodes MIN:MAX``, one
agent per node) goes on without (benchmarks/degraded.py).

Each rank appends JSON lines to ``<log-dir>/rank-<r>.jsonl``: ``phase`` events (process start,
imports, process group, model, optimizer, checkpoint load, first batch), one ``commit`` per step,
``save`` per checkpoint, ``fault`` when an injected fault fires, ``done`` with the final digest.
The log, the fault injection and the checkpoint/restart loop are ``ckptloop.py``'s, shared with
``train_fsdp_ckpt.py``; this script only wraps the model in DDP.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptloop as cl  # noqa: E402  (imports torch.distributed.checkpoint: part of the import phase)

_T_IMPORTED = time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cl.add_job_args(
        ap,
        hang_help="gloo collective timeout in steady state",
        digest_help="write the final weights' SHA-256 here",
    )
    ap.add_argument("--find-unused", type=int, choices=(0, 1), default=1, help="DDP find_unused_parameters")
    ap.add_argument("--broadcast-buffers", type=int, choices=(0, 1), default=0, help="DDP broadcast_buffers")
    args = ap.parse_args()

    job = cl.start_job(args, _T_START, _T_IMPORTED)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    job.log.phase("pg_ready")

    model = cl.build_model(job)
    # find_unused_parameters=True keeps the buckets fixed, so a restart is bitwise (REFERENCES);
    # the causal-mask buffer is a constant, so no per-step buffer broadcast
    ddp = DistributedDataParallel(
        model, find_unused_parameters=bool(args.find_unused), broadcast_buffers=bool(args.broadcast_buffers)
    )
    job.log.phase("model_ready")
    opt, sched = cl.make_optimizer(job, model)
    cl.train(job, ddp, opt, sched)

    final = job.example.weights_digest(model)
    job.log.emit("done", digest=final)
    if job.rank == 0:
        print(f"final weights sha256 {final}", flush=True)
        if args.digest_out:
            Path(args.digest_out).write_text(final + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
