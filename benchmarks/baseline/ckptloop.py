"""The checkpoint/restart loop shared by the torchrun baselines, ``train_ddp_ckpt.py`` (gloo DDP)
and ``train_fsdp_ckpt.py`` (FSDP2/HSDP).

The two scripts differ only in how the model is wrapped and how the final weights are digested;
everything a restart is measured by lives here, once, so the two designs cannot drift apart: the
per-rank JSON-lines log (``phase``, ``commit``, ``save``, ``fault``, ``done`` events that
benchmarks/recovery.py reads), fault injection that fires once per job across restarts, discovery
of the newest complete DCP checkpoint, and the training loop that loads it, resumes at its step and
saves every ``--ckpt-every`` K steps (model, optimizer, scheduler, step and each rank's RNG state).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "EXAMPLE",
    "FAULT_KINDS",
    "VOCAB",
    "Job",
    "RankLog",
    "add_job_args",
    "build_model",
    "latest_checkpoint",
    "load_example",
    "make_optimizer",
    "maybe_fire",
    "parse_faults",
    "start_job",
    "train",
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
FAULT_KINDS = ("raise", "kill", "hang", "node")
VOCAB = 256  # the example's byte-level vocabulary


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


def load_example(path: Path = EXAMPLE) -> ModuleType:
    """Import an example as a module: by default examples/train_gpt.py (its GPT,
    synthetic_batch and weights_digest)."""
    spec = importlib.util.spec_from_file_location(f"cl_example_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass in the file looks its module up there
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
        if kind == "node":
            # the whole node is lost: its torchrun agent (this worker's parent) with it, so an
            # elastic job (--nnodes MIN:MAX) must go on without the node, not restart it here
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint whose metadata was written (a save cut short has none)."""
    done = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def add_job_args(ap: argparse.ArgumentParser, *, hang_help: str, digest_help: str) -> None:
    """The flags both baselines take (the same names and defaults; only two help texts differ)."""
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
    ap.add_argument("--hang-timeout", type=float, default=10.0, help=hang_help)
    ap.add_argument("--start-timeout", type=float, default=120.0, help="gloo timeout until the first step")
    ap.add_argument("--inject", action="append", default=[], metavar="FAULT")
    ap.add_argument("--digest-out", help=digest_help)


@dataclass
class Job:
    """One (re)started process of a baseline job: who it is, where it logs, what it injects."""

    args: argparse.Namespace
    rank: int
    world: int
    attempt: int
    log_dir: Path
    ckpt_dir: Path
    log: RankLog
    faults: list[tuple[str, int, int]]
    local_batch: int
    example: ModuleType


def start_job(args: argparse.Namespace, t_start: float, t_imported: float) -> Job:
    """Read torchrun's environment, open this rank's log (with the start-up phases measured by the
    script before its heavy imports) and import the example; exits on a bad flag."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log_dir = Path(args.log_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else log_dir / "ckpt"
    log = RankLog(log_dir / f"rank-{rank}.jsonl", rank, attempt)
    log.phase("process_start", t_start, pid=os.getpid())
    log.phase("torch_imported", t_imported)
    faults = parse_faults(args.inject)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    ex = load_example()
    log.phase("example_imported")
    return Job(args, rank, world, attempt, log_dir, ckpt_dir, log, faults, args.global_batch // world, ex)


def build_model(job: Job) -> torch.nn.Module:
    """The example GPT from the job's seed, so every rank and every restart starts from the same weights."""
    a = job.args
    torch.manual_seed(a.seed)
    model: torch.nn.Module = job.example.GPT(VOCAB, a.dim, a.layers, a.heads, a.seq_len, a.dropout)
    return model


def make_optimizer(
    job: Job, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=job.args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, job.args.steps))
    job.log.phase("optimizer_ready")
    return opt, sched


def train(
    job: Job,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    vocab: int = VOCAB,
    step_fn: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
    state_key: str = "",
) -> None:
    """Resume from the newest complete checkpoint (if any), train to ``--steps``, saving every K.

    ``net`` is what the step calls and what the state dict is taken of: the DDP wrapper, or the
    ``fully_shard``-ed model, whose state dict is sharded (DCP then writes each rank's own shards;
    a tensor-parallel model's DTensors too). ``batch(step)``: this rank's (inputs, targets) of a
    step, the example GPT's synthetic batch when None; ``vocab``: the model's output width.
    ``step_fn(x, y)``: one whole training step (gradients zeroed, computed, applied) returning the
    loss, in place of the default forward, cross-entropy, backward and ``opt.step`` (a pipeline
    stage runs its schedule instead). ``state_key``: nest the model and optimizer state under it
    in the checkpoint: two pipeline stages' modules have the same parameter names ("0.weight")
    and DCP would take same-named plain tensors on two ranks for one replicated tensor.
    """
    a, rank, log = job.args, job.rank, job.log

    def full_state(step: int) -> dict[str, Any]:
        msd, osd = get_state_dict(net, opt)
        state: dict[str, Any] = {"step": step}
        if state_key:
            state[state_key] = {"model": msd, "optim": osd}
        else:
            state.update(model=msd, optim=osd)
        if sched is not None:
            state["sched"] = sched.state_dict()
        state[f"rng.{rank}"] = torch.get_rng_state()
        return state

    start = 0
    ckpt = latest_checkpoint(job.ckpt_dir) if a.ckpt_every > 0 else None
    if ckpt is not None:
        t0 = time.time()
        state = full_state(0)
        dcp.load(state, checkpoint_id=str(ckpt))
        ours = state[state_key] if state_key else state
        set_state_dict(net, opt, model_state_dict=ours["model"], optim_state_dict=ours["optim"])
        if sched is not None:
            sched.load_state_dict(state["sched"])
        torch.set_rng_state(state[f"rng.{rank}"])
        start = int(state["step"])
        log.phase("ckpt_loaded", path=ckpt.name, step=start, seconds=round(time.time() - t0, 6))
    else:
        log.phase("ckpt_loaded", path=None, step=0, seconds=0.0)

    short_timeout = datetime.timedelta(seconds=a.hang_timeout)
    for step in range(start, a.steps):
        maybe_fire(job.faults, rank, step, job.log_dir, log)
        if batch is None:
            tokens = job.example.synthetic_batch(a.seed, step, rank, job.local_batch, a.seq_len, VOCAB)
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            x, y = batch(step)
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        if step == start:
            log.phase("first_batch", step=step)
        if step_fn is None:
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
        else:
            value = step_fn(x, y)
        if sched is not None:
            sched.step()
        log.emit("commit", step=step, loss=round(value, 6), batch=digest)
        if rank == 0:
            print(f"step {step:4d}  loss {value:.4f}", flush=True)
        if step == start:
            # from now on a silent peer is a hang: fail the collective after --hang-timeout. Only the
            # default group's timeout changes; an FSDP mesh's subgroups keep the start timeout, which
            # matters for a hang only, not for the SIGKILL the sharded benchmark measures
            dist.distributed_c10d._set_pg_timeout(short_timeout)
        done = step + 1
        if a.ckpt_every > 0 and done % a.ckpt_every == 0 and done < a.steps:
            t0 = time.time()
            dcp.save(full_state(done), checkpoint_id=str(job.ckpt_dir / f"step-{done:06d}"))
            log.emit("save", step=done, seconds=round(time.time() - t0, 6))
