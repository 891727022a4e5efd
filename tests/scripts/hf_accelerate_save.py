"""An Accelerate loop whose protected section evaluates and then saves the model.

examples/hf_accelerate.py's model, data and loop (gradient accumulation, a scheduler, an
evaluation gathered over the ranks after each epoch), with two changes: after the evaluation's
last gather the section saves the model (``accelerator.save_model``, written by rank 0 alone)
into ``saved/epoch-E`` beside the digests, and which held-out batches it scores is drawn from
torch's global generator. It prints and logs to a tracker (``JsonLinesTracker``, in ``saved/``)
what it saved. A fault there, after the section's last collective, on one rank only (``--inject raise:rank=0:step=S:site=section``), is what the test rehearses:
its peers have nothing left to wait for in the section but the others.

Every rank's digest covers its weights, optimizer state and the evaluation losses the loop was
given; the saved files are compared by the test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built locally

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch
from _hf_common import Snippets, state_digest, tiny_gpt2, write_digest
from accelerate.tracking import GeneralTracker
from torch.utils.data import DataLoader

from checkpointless.integrations.hf_accelerate import CheckpointlessAccelerator


class JsonLinesTracker(GeneralTracker):
    """A tracker of accelerate's own kind (``log_with=[...]``, on the main process): each
    ``accelerator.log`` one JSON line in ``path``. With ``fails_at`` it raises once, as the
    values of that epoch reach it (a tracker that could not be reached); ``mark`` records that
    it did, for the job's other processes."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path, fails_at: int | None, mark: Path) -> None:
        super().__init__()
        self.path, self.fails_at, self.mark = path, fails_at, mark

    @property
    def tracker(self) -> Path:
        return self.path

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if values.get("epoch") == self.fails_at and not self.mark.exists():
            self.mark.write_text("fired")
            print(f"tracker failed once at epoch {self.fails_at}", flush=True)
            raise RuntimeError("the tracker could not be reached")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=80, help="per epoch, all ranks together")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", help="unused (the test harness passes a corpus); data is synthetic")
    ap.add_argument("--record-batches", action="store_true", help="batch digests in the commit events")
    ap.add_argument("--tracker-fails-at", type=int, help="the tracker raises once at this epoch's values")
    ap.add_argument("--digest-out", required=True, help="the digests' path, {rank} filled in")
    args = ap.parse_args()
    # beside the digests, so that a fault-free run and a faulted one each save into their own
    saved = Path(args.digest_out).parent / "saved"

    model = tiny_gpt2(args.seq_len, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    loader = DataLoader(
        Snippets(args.samples, args.seq_len, args.seed), batch_size=args.batch, shuffle=True, drop_last=True
    )
    held_out = DataLoader(Snippets(8 * args.batch, args.seq_len, args.seed + 1), batch_size=args.batch)
    tracker = JsonLinesTracker(
        saved / "tracker.jsonl", args.tracker_fails_at, saved.parent / "tracker-failed"
    )
    accelerator = CheckpointlessAccelerator(
        gradient_accumulation_steps=args.accumulation,
        cpu=True,
        log_with=[tracker],
        record_batches=args.record_batches,
    )
    accelerator.init_trackers("hf_accelerate_save")
    model, optimizer, loader, held_out, scheduler = accelerator.prepare(
        model, optimizer, loader, held_out, scheduler
    )
    steps_per_epoch = len(loader) // args.accumulation

    def evaluate_and_save() -> float:
        model.eval()
        # the batches scored are drawn from torch's global generator, as a sampled evaluation
        # would: the generators leave the section elsewhere than they began, and the steps
        # after it draw their dropout from there (a replacement must resume them there)
        scored = set(torch.randperm(len(held_out))[: len(held_out) - 1].tolist())
        losses = []
        with torch.no_grad():
            for i, batch in enumerate(held_out):
                if i in scored:  # as many on every rank: the gathers meet
                    losses.append(accelerator.gather_for_metrics(model(**batch).loss.reshape(1)))
        model.train()
        # the section's last collective is behind us: what follows runs on rank 0 alone
        epoch = accelerator.job.committed_step // steps_per_epoch - 1
        accelerator.save_model(model, saved / f"epoch-{epoch}")
        loss = float(torch.cat(losses).mean())
        accelerator.print(f"saved epoch-{epoch} after eval loss {loss:.6f}", flush=True)  # rank 0's
        accelerator.log({"epoch": epoch, "eval_loss": loss}, step=accelerator.job.committed_step)
        return loss

    evaluate_and_save = accelerator.protect(evaluate_and_save)
    eval_losses = []
    for epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        eval_losses.append({"epoch": epoch, "eval_loss": evaluate_and_save()})
        # every process prints what its loop was given: a section redone must not give it twice
        print(
            f"rank {accelerator.process_index} pid {os.getpid()} epoch {epoch} "
            f"eval loss {eval_losses[-1]['eval_loss']:.6f}",
            flush=True,
        )
    accelerator.end_training()
    digest = state_digest(accelerator.unwrap_model(model), optimizer.optimizer, eval_losses)
    write_digest(args.digest_out, accelerator.process_index, digest)


if __name__ == "__main__":
    main()
