"""A small Llama-style model on a 3-D mesh, torchtitan's layout: replicate x FSDP x TP.

    checkpointless run --nproc 8 --spares 1 examples/llama_3d.py
    checkpointless run --nproc 8 --spares 1 --inject kill:rank=5:step=6 examples/llama_3d.py

The model is Llama's shape in miniature: token embedding, blocks of RMSNorm + attention with
rotary position embeddings (RoPE) + RMSNorm + SwiGLU feed-forward, a final RMSNorm and an output
head. The mesh is torch's own ``init_device_mesh(device, (dp, shard, tp))`` made after
``checkpointless.init()``:

- "tp": ``parallelize_module`` splits each block's attention (q, k, v column-wise by head, the
  output projection row-wise) and its SwiGLU (w1, w3 column-wise, w2 row-wise), with torch's
  default ``src_data_rank`` (each shard scattered from tp rank 0 before the loop);
- "dp" x "shard": ``fully_shard`` over that 2-D sub-mesh after the TP split is FSDP2's HSDP:
  parameters sharded over "shard", replicated over "dp", gradients reduced over both.

The job learns the layout from the tracked DTensors (docs/adoption.md, "3-D parallel"): a rank's
state is named by its (shard, tp) coordinates and replicated over "dp", so a lost rank's comes
back from the rank with its (shard, tp) in the other dp replica. Each (dp, shard) rank reads a
batch of its own, a pure function of the step; the tp ranks of one (dp, shard) share it.

--digest-out PATH writes a hash of each rank's shards (parameters and AdamW state) to PATH with
"{rank}" filled in: compare a run with faults with one without.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import checkpointless


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim // 2)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (even, odd) feature pairs by the position's angles; x is (b, s, h, d)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: after the column-wise split each tp rank holds heads / tp of them
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, 4 * dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))  # type: ignore[no-any-return]


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(dim // heads, seq_len)
        self.register_buffer("cos", cos, persistent=False)  # derived: not part of the state
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def batch(step: int, replica: int, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of (dp, shard) rank ``replica`` at ``step``, and their next tokens."""
    g = torch.Generator().manual_seed(step * 1000 + replica)
    t = torch.randint(0, vocab, (4, seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(local(p).detach().cpu().contiguous().numpy().tobytes())
        for i, s in sorted(opt.state_dict()["state"].items()):
            for k, v in sorted(s.items()):
                h.update(f"{i}.{k}".encode())
                h.update(local(v).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dp", type=int, default=2, help="replicas (HSDP's replicate dimension)")
    ap.add_argument("--fsdp", type=int, default=2, help="FSDP shards within a replica")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides --heads)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--digest-out", help="write each rank's state digest here ({rank} filled in)")
    ap.add_argument("--data", help="ignored (the test helpers pass it)")
    args = ap.parse_args()

    job = checkpointless.init()  # a hot spare waits here until it is given a rank
    mesh = init_device_mesh(
        job.device.type, (args.dp, args.fsdp, args.tp), mesh_dim_names=("dp", "shard", "tp")
    )
    torch.manual_seed(0)  # one full model on every rank; each keeps its shards of it
    model = Llama(args.vocab, args.dim, args.heads, args.layers, args.seq_len).to(job.device)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], TP_PLAN)  # torch's default src_data_rank=0
    for block in model.layers:  # then FSDP2's HSDP over (dp, shard), block by block, as torchtitan
        fully_shard(block, mesh=mesh["dp", "shard"])
    fully_shard(model, mesh=mesh["dp", "shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after the splits: DTensor parameters
    job.track(model=model, optimizer=opt)
    replica = mesh.get_local_rank("dp") * args.fsdp + mesh.get_local_rank("shard")
    for step in job.steps(args.steps):
        with step:
            x, y = batch(step.index, replica, args.vocab, args.seq_len)
            logits = model(x.to(job.device))
            loss = F.cross_entropy(logits.flatten(0, 1), y.to(job.device).flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if job.rank == 0 and step.index % 5 == 0:
                print(f"step {step.index} loss {loss.item():.4f} (ln vocab {math.log(args.vocab):.2f})")
    if args.digest_out:
        Path(args.digest_out.format(rank=job.rank)).write_text(state_digest(model, opt))


if __name__ == "__main__":
    main()
