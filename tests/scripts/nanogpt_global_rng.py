"""nanoGPT's randomness, adopted without ``job.generator``: every generator is per rank.

As in karpathy/nanoGPT's train.py: the global torch generator is seeded ``1337 + rank`` (so are
Python's and NumPy's here), ``get_batch`` draws its offsets from it with ``torch.randint``, the
model's ``nn.Dropout`` draws its masks from it, and rank 0 alone draws evaluation batches from
it every few steps (in a ``job.section``, with dropout off). Each rank also draws from Python's
``random`` and NumPy's global generators (a token masked now and then), so all three must be
resumed. Every rank's stream differs from every other's and nothing but the per-rank seed and
the draws made so far decides it: a replacement that resumed a peer's generators, or a replay
that did not restore its own, trains on other batches and ends with other weights.

Every rank writes its final weights' SHA-256 (``--digest-out``), as tests/scripts/adopt.py does.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F
from adopt import digest, write_digest
from torch import nn

import checkpointless as cl

BLOCK = 16
BATCH = 8


class CharModel(nn.Module):
    """A tiny character model: embeddings, dropout, one MLP block, a head."""

    def __init__(self, vocab: int, dim: int = 32, dropout: float = 0.2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(BLOCK, dim)
        self.drop = nn.Dropout(dropout)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(h + self.mlp(h))  # type: ignore[no-any-return]


def corpus() -> torch.Tensor:
    r = random.Random(0)  # the data itself is the same on every rank and every run
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "by", "the", "door"]
    text = " ".join(r.choice(words) for _ in range(600))
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-iters", type=int, default=2)
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    data = corpus()
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    vocab = int(data.max()) + 1

    job = cl.init()
    # nanoGPT: torch.manual_seed(1337 + seed_offset), seed_offset = the rank
    torch.manual_seed(1337 + job.rank)
    random.seed(1337 + job.rank)
    np.random.seed(1337 + job.rank)
    # one Gaussian from NumPy's and Python's generators here and one a step: each draws a pair
    # and keeps the second for the next call, so after every odd number of draws (the faults'
    # steps here) a resumed rank needs its generators' cached Gaussians back too
    np.random.normal()
    random.gauss(0, 1)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - BLOCK, (BATCH,))  # the global generator, as nanoGPT
        x = torch.stack([d[i : i + BLOCK] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y

    net = CharModel(vocab)  # its initial weights differ per rank: the first round sends rank 0's
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    model = job.data_parallel(net, optimizer=opt)

    @torch.no_grad()
    def estimate_loss() -> None:
        if job.rank != 0:  # nanoGPT's master_process only
            return
        net.eval()
        for split in ("train", "val"):
            losses = [
                F.cross_entropy(net(x).flatten(0, 1), y.flatten()).item()
                for x, y in (get_batch(split) for _ in range(args.eval_iters))
            ]
            job.record(**{f"{split}_loss": sum(losses) / len(losses)})
        net.train()

    job.section("eval", estimate_loss, every=args.eval_every)

    for step in job.steps(args.steps):
        with step:
            x, y = get_batch("train")
            if random.random() < 0.5:  # a per-rank draw from Python's generator and NumPy's
                x[0, int(np.random.randint(BLOCK))] = 0
            x[1, int(abs(np.random.normal() + random.gauss(0, 1)) * 1000) % BLOCK] = 0
            job.record(batch=digest(x, y))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    write_digest(args.digest_out, job.rank, net.state_dict())


if __name__ == "__main__":
    main()
