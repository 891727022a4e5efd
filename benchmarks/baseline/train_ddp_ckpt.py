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

Faults (``--inject KIND:rank=R:step=S``, repeatable; KIND raise, kill or hang) fire as the rank
begins step S, once per job (a marker file in --log-dir remembers it across restarts). ``hang``
stops the process with SIGSTOP: the survivors then wait in their all-reduce until the gloo timeout
(``--hang-timeout``, applied once the first step after each start has completed, so a slow start
is not mistaken for a hang) fails them and torchrun restarts everyone.

Each rank appends JSON lines to ``<log-dir>/rank-<r>.jsonl``: ``phase`` events (process start,
imports, process group, model, optimizer, checkpoint load, first batch), one ``commit`` per step,
``save`` per checkpoint, ``fault`` when an injected fault fires, ``done`` with the final digest.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any, TextIO  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

_T_IMPORTED = time.time()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
FAULT_KINDS = ("raise", "kill", "hang")


class RankLog:
    """Append-only JSON lines, one flushed write per event (a killed process loses nothing)."""

    def __init__(self, path: Path, rank: int, attempt: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - process lifetime
        self.rank = rank
        self.attempt = attempt

    def emit(self, event: str, t: float | None = None, **fields: Any) -> None:
        rec = {"time": round(time.time() if t is None else t, 6), "event": event, "rank": self.rank}
        rec.update(attempt=self.attempt, **fields)
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._f.flush()

    def phase(self, name: str, t: float | None = None, **fields: Any) -> None:
        self.emit("phase", t, name=name, **fields)


def load_example() -> ModuleType:
    """Import examples/train_gpt.py as a module (its GPT, synthetic_batch and weights_digest)."""
    spec = importlib.util.spec_from_file_location("cl_example_train_gpt", EXAMPLE)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {EXAMPLE}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_faults(texts: list[str]) -> list[tuple[str, int, int]]:
    out = []
    for text in texts:
        kind, *kvs = text.split(":")
        fields = dict(kv.split("=", 1) for kv in kvs)
        if kind not in FAULT_KINDS or "rank" not in fields or "step" not in fields:
            raise SystemExit(f"bad --inject {text!r}: use KIND:rank=R:step=S with KIND in {FAULT_KINDS}")
        out.append((kind, int(fields["rank"]), int(fields["step"])))
    return out


def maybe_fire(faults: list[tuple[str, int, int]], rank: int, step: int, log_dir: Path, log: RankLog) -> None:
    for kind, frank, fstep in faults:
        if frank != rank or fstep != step:
            continue
        marker = log_dir / f"fired-{kind}-r{frank}-s{fstep}"
        if marker.exists():
            continue  # fires once per job, not again after the restart
        marker.write_text(f"{time.time()}\n")
        log.emit("fault", kind=kind, step=step, fired_at=time.time())
        print(f"[rank {rank}] injecting {kind} at step {step}", file=sys.stderr, flush=True)
        if kind == "raise":
            raise RuntimeError(f"injected fault raise:rank={rank}:step={step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint whose metadata was written (a save cut short has none)."""
    done = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        "--hang-timeout", type=float, default=10.0, help="gloo collective timeout in steady state"
    )
    ap.add_argument("--start-timeout", type=float, default=120.0, help="gloo timeout until the first step")
    ap.add_argument("--inject", action="append", default=[], metavar="FAULT")
    ap.add_argument("--digest-out", help="write the final weights' SHA-256 here")
    ap.add_argument("--find-unused", type=int, choices=(0, 1), default=1, help="DDP find_unused_parameters")
    ap.add_argument("--broadcast-buffers", type=int, choices=(0, 1), default=0, help="DDP broadcast_buffers")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log_dir = Path(args.log_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else log_dir / "ckpt"
    log = RankLog(log_dir / f"rank-{rank}.jsonl", rank, attempt)
    log.phase("process_start", _T_START, pid=os.getpid())
    log.phase("torch_imported", _T_IMPORTED)
    faults = parse_faults(args.inject)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    local_batch = args.global_batch // world

    ex = load_example()
    log.phase("example_imported")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    log.phase("pg_ready")

    torch.manual_seed(args.seed)
    vocab = 256
    model = ex.GPT(vocab, args.dim, args.layers, args.heads, args.seq_len, args.dropout)
    # find_unused_parameters=True keeps the buckets fixed, so a restart is bitwise (REFERENCES);
    # the causal-mask buffer is a constant, so no per-step buffer broadcast
    ddp = DistributedDataParallel(
        model, find_unused_parameters=bool(args.find_unused), broadcast_buffers=bool(args.broadcast_buffers)
    )
    log.phase("model_ready")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    log.phase("optimizer_ready")

    start = 0
    ckpt = latest_checkpoint(ckpt_dir) if args.ckpt_every > 0 else None
    if ckpt is not None:
        t0 = time.time()
        msd, osd = get_state_dict(ddp, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0}
        state[f"rng.{rank}"] = torch.get_rng_state()
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state[f"rng.{rank}"])
        start = int(state["step"])
        log.phase("ckpt_loaded", path=ckpt.name, step=start, seconds=round(time.time() - t0, 6))
    else:
        log.phase("ckpt_loaded", path=None, step=0, seconds=0.0)

    short_timeout = datetime.timedelta(seconds=args.hang_timeout)
    for step in range(start, args.steps):
        maybe_fire(faults, rank, step, log_dir, log)
        tokens = ex.synthetic_batch(args.seed, step, rank, local_batch, args.seq_len, vocab)
        x, y = tokens[:, :-1], tokens[:, 1:]
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        if step == start:
            log.phase("first_batch", step=step)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.emit("commit", step=step, loss=round(loss.item(), 6), batch=digest)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
        if step == start:
            # from now on a silent peer is a hang: fail the collective after --hang-timeout
            dist.distributed_c10d._set_pg_timeout(short_timeout)
        done = step + 1
        if args.ckpt_every > 0 and done % args.ckpt_every == 0 and done < args.steps:
            t0 = time.time()
            msd, osd = get_state_dict(ddp, opt)
            state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": done}
            state[f"rng.{rank}"] = torch.get_rng_state()
            dcp.save(state, checkpoint_id=str(ckpt_dir / f"step-{done:06d}"))
            log.emit("save", step=done, seconds=round(time.time() - t0, 6))

    final = ex.weights_digest(model)
    log.emit("done", digest=final)
    if rank == 0:
        print(f"final weights sha256 {final}", flush=True)
        if args.digest_out:
            Path(args.digest_out).write_text(final + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
