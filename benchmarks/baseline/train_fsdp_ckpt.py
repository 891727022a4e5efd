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

Logs, fault injection and checkpoint discovery are those of ``train_ddp_ckpt.py`` (imported), so
benchmarks/recovery.py reads both the same way: ``phase`` events, one ``commit`` per step, ``save``
per checkpoint, ``fault``, ``done``. ``--digest-out`` may hold ``{rank}``: each rank then writes the
digest of its own shards.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_ddp_ckpt as ddp_base  # noqa: E402

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
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ckpt-every", type=int, default=10, help="save a checkpoint every K steps (0: never)")
    ap.add_argument("--ckpt-dir", help="checkpoint directory (default: <log-dir>/ckpt)")
    ap.add_argument("--log-dir", required=True, help="where rank-<r>.jsonl and fault markers go")
    ap.add_argument(
        "--hang-timeout", type=float, default=10.0, help="gloo timeout once the first step is done"
    )
    ap.add_argument("--start-timeout", type=float, default=120.0, help="gloo timeout until the first step")
    ap.add_argument("--inject", action="append", default=[], metavar="FAULT")
    ap.add_argument("--digest-out", help="write the final shards' SHA-256 here; {rank}: one file per rank")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shape = parse_mesh(args.fsdp, world)
    log_dir = Path(args.log_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else log_dir / "ckpt"
    log = ddp_base.RankLog(log_dir / f"rank-{rank}.jsonl", rank, attempt)
    log.phase("process_start", _T_START, pid=os.getpid())
    log.phase("torch_imported", _T_IMPORTED)
    faults = ddp_base.parse_faults(args.inject)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    local_batch = args.global_batch // world

    ex = ddp_base.load_example()
    log.phase("example_imported")
    # one timeout for every group the mesh creates: a slow start must not look like a hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    log.phase("pg_ready")

    torch.manual_seed(args.seed)
    vocab = 256
    model = ex.GPT(vocab, args.dim, args.layers, args.heads, args.seq_len, args.dropout)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log.phase("model_ready")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    log.phase("optimizer_ready")

    def full_state(step: int) -> dict[str, Any]:
        # get_state_dict of an FSDP2 model is sharded: DCP writes each rank's own shards
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step}
        state[f"rng.{rank}"] = torch.get_rng_state()
        return state

    start = 0
    ckpt = ddp_base.latest_checkpoint(ckpt_dir) if args.ckpt_every > 0 else None
    if ckpt is not None:
        t0 = time.time()
        state = full_state(0)
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state[f"rng.{rank}"])
        start = int(state["step"])
        log.phase("ckpt_loaded", path=ckpt.name, step=start, seconds=round(time.time() - t0, 6))
    else:
        log.phase("ckpt_loaded", path=None, step=0, seconds=0.0)

    short_timeout = datetime.timedelta(seconds=args.hang_timeout)
    for step in range(start, args.steps):
        ddp_base.maybe_fire(faults, rank, step, log_dir, log)
        tokens = ex.synthetic_batch(args.seed, step, rank, local_batch, args.seq_len, vocab)
        x, y = tokens[:, :-1], tokens[:, 1:]
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        if step == start:
            log.phase("first_batch", step=step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.emit("commit", step=step, loss=round(loss.item(), 6), batch=digest)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
        if step == start:
            # from now on a silent peer is a hang (the default group; the mesh's subgroups keep
            # the start timeout, which only matters for a hang, not for the SIGKILL measured)
            dist.distributed_c10d._set_pg_timeout(short_timeout)
        done = step + 1
        if args.ckpt_every > 0 and done % args.ckpt_every == 0 and done < args.steps:
            t0 = time.time()
            dcp.save(full_state(done), checkpoint_id=str(ckpt_dir / f"step-{done:06d}"))
            log.emit("save", step=done, seconds=round(time.time() - t0, 6))

    final = ex.weights_digest(model)  # this rank's shards
    log.emit("done", digest=final)
    if args.digest_out and ("{rank}" in args.digest_out or rank == 0):
        ex.write_digest(Path(args.digest_out.replace("{rank}", str(rank))), final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
