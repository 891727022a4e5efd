"""Per-rank global randomness at a steady pace, for a host loss in the middle of the run.

Each rank seeds the global generators with ``1337 + rank`` (as nanoGPT does), draws its batch
offsets from torch's with ``torch.randint`` and its dropout masks from it through ``nn.Dropout``,
and draws from Python's ``random`` now and then; nothing goes through ``job.generator``. With ``--loader``
half of each batch's offsets come from a torchdata ``StatefulDataLoader`` with ``shuffle=True``
under ``job.loader()``: its sampler's generator is seeded from the per-rank global seed as the
loader is built, so its position (the sampler's generator, carried in the loader's state) is per
rank, and a rank that took its replica's state would shuffle as the sender does. Each
step sleeps ``--sleep`` seconds, so that a test can lose a host while the job trains. Every rank
writes its final weights' SHA-256 (``--digest-out``), as tests/scripts/adopt.py does.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F
from adopt import digest, write_digest
from nanogpt_global_rng import BATCH, BLOCK, CharModel, corpus

import checkpointless as cl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--loader", action="store_true", help="half the offsets from a per-rank shuffled loader")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    ap.add_argument("--digest-out", required=True)
    args = ap.parse_args()

    data = corpus()
    vocab = int(data.max()) + 1
    job = cl.init()
    torch.manual_seed(1337 + job.rank)
    random.seed(1337 + job.rank)
    net = CharModel(vocab)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    model = job.data_parallel(net, optimizer=opt)
    loader = None
    if args.loader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        # 64 offsets in batches of 4: 16 steps an epoch, so a run of 30 crosses an epoch, whose
        # order the sampler's generator draws on from where the first one left it
        offsets = [i * ((len(data) - BLOCK - 1) // 64) for i in range(64)]
        # shuffle=True: its generator is seeded from torch's global one, seeded per rank above
        loader = job.loader(StatefulDataLoader(offsets, batch_size=BATCH // 2, shuffle=True))
    for step in job.steps(args.steps):
        with step:
            ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))  # the global generator, per rank
            if loader is not None:
                ix = torch.cat([ix[: BATCH // 2], loader.batch(step.index)])
            x = torch.stack([data[i : i + BLOCK] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
            if random.random() < 0.5:
                x[0, 0] = 0
            job.record(batch=digest(x, y))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # dropout: per-rank masks
            opt.zero_grad(set_to_none=True)
            loss.backward()
            time.sleep(args.sleep)
            opt.step()
    write_digest(args.digest_out, job.rank, net.state_dict())


if __name__ == "__main__":
    main()
