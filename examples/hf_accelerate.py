"""A hand-written Accelerate loop over a small GPT-2, surviving faults in process.

The model is built from a config and the data from memory: nothing is fetched from the hub.
Plain Accelerate (torchrun starts the ranks, DDP):

    torchrun --nproc-per-node 2 examples/hf_accelerate.py --accelerator plain

Under checkpointless (the lines marked "checkpointless" below are the whole adoption):

    checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=5 examples/hf_accelerate.py

At the end every rank prints/writes a SHA-256 of its final weights and optimizer state
(--digest-out, with {rank}), so a run with faults can be compared bit for bit with one without.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built locally

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import Snippets

from checkpointless.integrations.hf_accelerate import CheckpointlessAccelerator  # checkpointless


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for pid, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{pid}/{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", choices=["checkpointless", "plain"], default="checkpointless")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=80, help="per epoch, all ranks together")
    ap.add_argument("--batch", type=int, default=4, help="per rank and micro-batch")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", help="unused (the test harness passes a corpus); data is synthetic")
    ap.add_argument("--digest-out", help="write the final state's SHA-256 here; {rank} is filled in")
    args = ap.parse_args()

    torch.manual_seed(args.seed)  # the same model on every rank
    vocab = 64
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    data = Snippets(args.samples, args.seq_len, vocab, args.seed)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    kwargs = {
        "gradient_accumulation_steps": args.accumulation,
        "cpu": True,
        "mixed_precision": args.mixed_precision,
    }
    if args.accelerator == "plain":
        accelerator = Accelerator(**kwargs)
    else:
        accelerator = CheckpointlessAccelerator(**kwargs)  # checkpointless
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    accelerator.end_training()  # checkpointless: every rank waits here for the job's end

    inner = accelerator.unwrap_model(model)
    inner = getattr(inner, "module", inner)  # the job's DataParallel
    digest = state_digest(inner, optimizer.optimizer)
    rank = accelerator.process_index
    if rank == 0:
        print(f"final state sha256 {digest}", flush=True)
    if args.digest_out:
        path = Path(args.digest_out.replace("{rank}", str(rank)))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, path)  # whole or not at all: a reader must never see half a digest


if __name__ == "__main__":
    main()
