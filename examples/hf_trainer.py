"""Train a small GPT-2 with Hugging Face's ``transformers.Trainer``, surviving faults in process.

The model is built from a config and the data from memory: nothing is fetched from the hub.
Plain Trainer (torchrun starts the ranks, DDP):

    torchrun --nproc-per-node 2 examples/hf_trainer.py --trainer plain

Under checkpointless (the two lines marked "checkpointless" below are the whole adoption):

    checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=5 examples/hf_trainer.py

At the end every rank prints/writes a SHA-256 of its final weights, optimizer state and log
history (--digest-out, with {rank}), so a run with faults can be compared bit for bit with one
without.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built locally

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from checkpointless.integrations.hf import CheckpointlessTrainer  # checkpointless


class Snippets(Dataset[dict[str, torch.Tensor]]):
    """Sample i: ``seq_len`` tokens of a repeating pattern with noise, a function of (seed, i)."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, self.vocab, (), generator=g))
        ids = (start + torch.arange(self.seq_len) * 3) % self.vocab
        noise = torch.rand(self.seq_len, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, self.vocab, (self.seq_len,), generator=g), ids)
        return {"input_ids": ids, "labels": ids.clone()}


def state_digest(trainer: Trainer) -> str:
    """SHA-256 of the weights, the optimizer's state and the log history (without timings)."""
    h = hashlib.sha256()
    for name, t in sorted(trainer.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert trainer.optimizer is not None
    for pid, state in sorted(trainer.optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{pid}/{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    logs = [
        {k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}
        for entry in trainer.state.log_history
    ]
    h.update(json.dumps(logs, sort_keys=True).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", choices=["checkpointless", "plain"], default="checkpointless")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4, help="per rank and micro-batch")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--output-dir", default="runs/hf_trainer")
    ap.add_argument("--save-steps", type=int, default=0, help="Trainer checkpoints every N steps (0: none)")
    ap.add_argument("--resume", help="a checkpoint-N folder to resume from (resume_from_checkpoint)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--record-batches", action="store_true", help="batch digests in the commit events")
    ap.add_argument("--data", help="unused (the test harness passes a corpus); data is synthetic")
    ap.add_argument("--digest-out", help="write the final state's SHA-256 here; {rank} is filled in")
    args = ap.parse_args()

    torch.manual_seed(args.seed)  # the same model on every rank; built before the trainer joins
    vocab = 64
    config = GPT2Config(
        vocab_size=vocab, n_positions=args.seq_len, n_embd=args.dim, n_layer=args.layers, n_head=2
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    data = Snippets(args.samples, args.seq_len, vocab, args.seed)
    if args.trainer == "plain":
        trainer: Trainer = Trainer(model=model, args=training_args, train_dataset=data)
    else:
        trainer = CheckpointlessTrainer(  # checkpointless
            model=model, args=training_args, train_dataset=data, record_batches=args.record_batches
        )
    trainer.train(resume_from_checkpoint=args.resume)

    digest = state_digest(trainer)
    rank = training_args.process_index
    if rank == 0:
        print(f"final state sha256 {digest}", flush=True)
    if args.digest_out:
        path = Path(args.digest_out.replace("{rank}", str(rank)))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, path)  # whole or not at all: a reader must never see half a digest


if __name__ == "__main__":
    main()
