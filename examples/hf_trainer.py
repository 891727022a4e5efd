"""Train a small GPT-2 with Hugging Face's ``transformers.Trainer``, surviving faults in process.

The model is built from a config and the data from memory: nothing is fetched from the hub.
Plain Trainer (torchrun starts the ranks, DDP):

    torchrun --nproc-per-node 2 examples/hf_trainer.py --trainer plain

Under checkpointless (the two lines marked "checkpointless" below are the whole adoption):

    checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=5 examples/hf_trainer.py

With --eval-steps N Trainer evaluates on held-out data every N steps; the evaluation runs in a
protected section, so a fault during it is recovered and the evaluation done again.

At the end every rank prints/writes a SHA-256 of its final weights, optimizer state and log
history, evaluation metrics included (--digest-out, with {rank}), so a run with faults can be
compared bit for bit with one without. The model, data and digest are examples/_hf_common.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built locally

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hf_common import Snippets, state_digest, tiny_gpt2, write_digest

from checkpointless.integrations.hf import CheckpointlessTrainer  # checkpointless


def main(callbacks: Sequence[TrainerCallback] = ()) -> Trainer:
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
    ap.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    ap.add_argument(
        "--resume",
        help="resume_from_checkpoint: a checkpoint-N folder, or 'last' for the newest in --output-dir "
        "if there is one (what a script restarted by torchrun --max-restarts passes)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--record-batches", action="store_true", help="batch digests in the commit events")
    ap.add_argument("--data", help="unused (the test harness passes a corpus); data is synthetic")
    ap.add_argument("--digest-out", help="write the final state's SHA-256 here; {rank} is filled in")
    args = ap.parse_args()

    model = tiny_gpt2(args.seq_len, args.dim, args.layers, seed=args.seed)  # before the trainer joins
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
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=args.batch,
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    data = Snippets(args.samples, args.seq_len, args.seed)
    held_out = Snippets(8 * args.batch, args.seq_len, args.seed + 1) if args.eval_steps else None
    common = {"model": model, "args": training_args, "train_dataset": data, "eval_dataset": held_out}
    if args.trainer == "plain":
        trainer: Trainer = Trainer(**common, callbacks=list(callbacks))
    else:
        trainer = CheckpointlessTrainer(  # checkpointless
            **common, callbacks=list(callbacks), record_batches=args.record_batches
        )
    resume = args.resume
    if resume == "last":
        resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=resume)

    assert trainer.optimizer is not None
    digest = state_digest(trainer.model, trainer.optimizer, trainer.state.log_history)
    write_digest(args.digest_out, training_args.process_index, digest)
    return trainer


if __name__ == "__main__":
    main()
