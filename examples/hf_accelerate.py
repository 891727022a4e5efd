"""A hand-written Accelerate loop over a small GPT-2, surviving faults in process.

The model is built from a config and the data from memory: nothing is fetched from the hub.
Plain Accelerate (torchrun starts the ranks, DDP):

    torchrun --nproc-per-node 2 examples/hf_accelerate.py --accelerator plain

Under checkpointless (the lines marked "checkpointless" below are the whole adoption):

    checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=5 examples/hf_accelerate.py

After each epoch the loop evaluates on held-out data (a DataLoader prepared by accelerate, its
losses gathered over the ranks); under checkpointless that evaluation is a protected section, so
a fault during it is recovered and the evaluation done again.

At the end every rank prints/writes a SHA-256 of its final weights, optimizer state and evaluation
losses (--digest-out, with {rank}), so a run with faults can be compared bit for bit with one
without. The model, data and digest are examples/_hf_common.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built locally

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hf_common import Snippets, state_digest, tiny_gpt2, write_digest

from checkpointless.integrations.hf_accelerate import CheckpointlessAccelerator  # checkpointless


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
    ap.add_argument("--record-batches", action="store_true", help="batch digests in the commit events")
    ap.add_argument("--data", help="unused (the test harness passes a corpus); data is synthetic")
    ap.add_argument("--digest-out", help="write the final state's SHA-256 here; {rank} is filled in")
    args = ap.parse_args()

    model = tiny_gpt2(args.seq_len, seed=args.seed)  # the same model on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    data = Snippets(args.samples, args.seq_len, args.seed)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    held_out = DataLoader(Snippets(8 * args.batch, args.seq_len, args.seed + 1), batch_size=args.batch)
    kwargs = {
        "gradient_accumulation_steps": args.accumulation,
        "cpu": True,
        "mixed_precision": args.mixed_precision,
    }
    if args.accelerator == "plain":
        accelerator = Accelerator(**kwargs)
    else:
        accelerator = CheckpointlessAccelerator(  # checkpointless
            **kwargs, record_batches=args.record_batches
        )
    model, optimizer, loader, held_out, scheduler = accelerator.prepare(
        model, optimizer, loader, held_out, scheduler
    )

    def evaluate() -> float:
        model.eval()
        losses = []
        with torch.no_grad():
            for batch in held_out:
                losses.append(accelerator.gather_for_metrics(model(**batch).loss.reshape(1)))
        model.train()
        return float(torch.cat(losses).mean())

    if isinstance(accelerator, CheckpointlessAccelerator):
        evaluate = accelerator.protect(evaluate)  # checkpointless: runs as a protected section
    eval_losses = []
    for epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        eval_losses.append({"epoch": epoch, "eval_loss": evaluate()})
        if accelerator.is_main_process:
            print(f"epoch {epoch} eval loss {eval_losses[-1]['eval_loss']:.4f}", flush=True)
    accelerator.end_training()  # checkpointless: every rank waits here for the job's end

    digest = state_digest(accelerator.unwrap_model(model), optimizer.optimizer, eval_losses)
    write_digest(args.digest_out, accelerator.process_index, digest)


if __name__ == "__main__":
    main()
