"""A small GPT-style decoder trained data-parallel under checkpointless.

Run it plainly (one process) or under the launcher:

    checkpointless run --nproc 4 --spares 1 examples/train_gpt.py --steps 60
    checkpointless run --nproc 4 --spares 1 --inject kill:rank=1:step=20 examples/train_gpt.py

It prints the loss per step and, at the end, the SHA-256 of the final weights (also written to
--digest-out), so a run with faults can be compared bit for bit with one without. A ``{rank}`` in
the --digest-out path makes every rank write its own file, so that all replicas can be compared,
not rank 0's alone (a broken gradient average leaves rank 0 looking fine).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import checkpointless as cl


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False
        )
        self.checkpointing = False  # recompute each block's activations in backward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for b in self.blocks:
            if self.checkpointing and self.training:
                # the block runs again in backward (its dropout masks reproduced from the saved RNG
                # state; under FSDP2 its parameters all-gathered again)
                x = checkpoint(b, x, self.mask[:t, :t], use_reentrant=False)
            else:
                x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of this rank's weights: the whole model, or under --fsdp this rank's shards."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if isinstance(t, DTensor):
            t = t.to_local()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def synthetic_batch(seed: int, step: int, rank: int, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Deterministic tokens for (seed, step, rank): a pure function, so a replay reads the same."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", help="token file from `checkpointless data prepare` (default: random tokens)")
    ap.add_argument(
        "--digest-out",
        help="write the final weights' SHA-256 here (rank 0 only); a {rank} in the path, e.g. "
        "runs/w.{rank}.digest, makes every rank write its own file",
    )
    ap.add_argument(
        "--fsdp",
        metavar="R,S",
        help="shard with torch's FSDP2 over an R x S (replicate, shard) mesh: 1,S is FSDP, R,S HSDP",
    )
    ap.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="with --fsdp: FSDP2 mixed precision, parameters gathered and computed in this dtype, "
        "gradients reduced in float32 (the sharded parameters and optimizer stay float32)",
    )
    ap.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="K",
        help="split each rank's batch into K micro-batches whose gradients add up before one "
        "reduction (FSDP2's set_requires_gradient_sync, data parallel's no_sync)",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute every block's activations in backward (torch.utils.checkpoint) instead of keeping them",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile each transformer block with torch.compile (inductor) before sharding or data "
        "parallel, as torchtitan does; a replacement compiles again (from inductor's cache) on its first step",
    )
    args = ap.parse_args()

    # Everything that does not depend on the rank is built before init(): a hot spare builds it
    # while it waits, so taking over a failed rank costs it no model construction.
    torch.manual_seed(args.seed)
    vocab = 256
    if args.data:
        from checkpointless.data import TokenDataset, prefetch_as_spare

        ds = TokenDataset.open(args.data, verify="quick")
        vocab = ds.vocab_size
        if not args.fsdp:  # a spare on a spare host fills its own cache for the ranks it may take
            prefetch_as_spare(ds, seq_len=args.seq_len, global_batch=args.global_batch, seed=args.seed)
    model = GPT(vocab, args.dim, args.layers, args.heads, args.seq_len, args.dropout)
    model.checkpointing = args.activation_checkpointing
    recomputed = [0]  # blocks whose forward ran again in this step's backward
    if args.activation_checkpointing:

        def count_recompute(module: nn.Module, inputs: object) -> None:
            # a forward run by the autograd engine is torch.utils.checkpoint recomputing it
            if torch._C._current_graph_task_id() != -1:
                recomputed[0] += 1

        for block in model.blocks:
            block.register_forward_pre_hook(count_recompute)
    if args.compile:
        # in place (Module.compile), so parameter names and the tracked state keep their keys;
        # compilation itself happens on the first forward
        for block in model.blocks:
            block.compile()
    if not args.fsdp:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))

    job = cl.init()  # a hot spare waits here until it is given a rank
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # the mesh's groups are the job's: they are re-formed, never rebuilt, after a fault
        shape = tuple(int(n) for n in args.fsdp.split(","))
        mesh = job.device_mesh(("replicate", "shard"), shape)
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        # after fully_shard: the optimizer must hold the sharded parameters
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    if args.global_batch % job.world_size:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {job.world_size} ranks")
    local_batch = args.global_batch // job.world_size
    if args.grad_accum < 1 or local_batch % args.grad_accum:
        raise SystemExit(
            f"--grad-accum {args.grad_accum} does not divide the {local_batch} sequences per rank"
        )
    loader = None
    if args.data:
        from checkpointless.data import BatchLoader, ShmBatchCache

        # prefetched batches wait in /dev/shm, so a replacement's first batch is a memory read
        cache = ShmBatchCache(job_id=job.job_id, rank=job.rank, capacity=8) if job.job_id else None
        loader = BatchLoader(
            ds,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            seed=args.seed,
            dp_rank=job.rank,  # the flat rank over (replicate, shard) on a mesh
            dp_size=job.world_size,
            cache=cache,
        )
    # in place: the optimizer keeps its parameters; FSDP2 does its own gradient reduction
    dp = model if args.fsdp else job.data_parallel(model.to(job.device))
    job.track(model=model, optimizer=opt, scheduler=sched)

    for step in job.steps(args.steps):
        with step:
            if loader is not None:
                x, y = loader.batch(step.index)
            else:
                tokens = synthetic_batch(args.seed, step.index, job.rank, local_batch, args.seq_len, vocab)
                x, y = tokens[:, :-1], tokens[:, 1:]
            job.record(batch=hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16])
            x, y = x.to(job.device), y.to(job.device)
            opt.zero_grad(set_to_none=True)
            recomputed[0] = 0
            loss = torch.zeros((), device=job.device)  # the step's loss: the micro-batches' sum
            for xs, ys, last in micro_batches(x, y, args.grad_accum):
                if args.grad_accum > 1:  # only the last micro-batch's backward reduces (all K's sum)
                    if args.fsdp:
                        model.set_requires_gradient_sync(last)
                    else:
                        dp.require_backward_grad_sync = last
                logits = dp(xs)
                part = F.cross_entropy(logits.reshape(-1, vocab), ys.reshape(-1)) / args.grad_accum
                part.backward()
                loss += part.detach()
            opt.step()
            sched.step()
            job.record(loss=round(loss.item(), 6))
            if args.activation_checkpointing:
                job.record(recomputed=recomputed[0])
            if job.rank == 0:
                print(
                    f"step {step.index:4d}  loss {loss.item():.4f}  ppl {math.exp(min(loss.item(), 20)):.1f}",
                    flush=True,
                )

    if loader is not None:
        loader.close()
    digest = weights_digest(model)
    if job.rank == 0:
        print(f"final weights sha256 {digest}", flush=True)
    if args.digest_out and ("{rank}" in args.digest_out or job.rank == 0):
        write_digest(Path(args.digest_out.replace("{rank}", str(job.rank))), digest)


def micro_batches(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """``k`` equal slices of a batch, each with whether it is the last."""
    xs, ys = x.chunk(k), y.chunk(k)
    return [(a, b, i == k - 1) for i, (a, b) in enumerate(zip(xs, ys, strict=True))]


def write_digest(path: Path, digest: str) -> None:
    """Write the file whole or not at all: a reader must never take half a digest for a mismatch."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
