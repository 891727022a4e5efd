"""A ``CheckpointlessTrainer`` job that evaluates and saves at the end of each epoch and loads the
best checkpoint at the end (``eval_strategy="epoch"``, ``save_strategy="epoch"``,
``load_best_model_at_end=True``, ``metric_for_best_model="eval_loss"``), with faults where
Trainer evaluates and saves.

The model and data are examples/_hf_common.py's (a 2-layer GPT-2, data made in memory).
``HF_FAULTS`` is a comma-separated list of ``KIND:WHERE:RANK:STEP`` (KIND ``kill`` or ``raise``;
WHERE ``eval``, at the rank's second evaluation batch, ``save``, after the checkpoint's
weights are written and before its optimizer, RNG and trainer state: a half-written checkpoint,
or ``log``, in a callback's ``on_log`` of the evaluation's line, called after Trainer's printer
has shown it: once the boundary's section has closed on every rank),
each fired once, by rank RANK when ``state.global_step == STEP``; the file ``HF_FAULT_MARKS``
(``{n}`` the fault's index) records that it fired, so that neither the rank after a raise nor
its replacement after a kill fires it again.

At the end every rank writes ``HF_EPOCH_OUT`` ({rank} filled in): its evaluation entries, the
best metric, step and checkpoint (its folder's name), for the test to compare with the fault-free
run's; the final state's digest (weights after the best model was loaded, optimizer, log history)
goes to ``--digest-out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _hf_common import Snippets, state_digest, tiny_gpt2, without_timings, write_digest
from transformers import TrainerCallback, TrainingArguments

from checkpointless.integrations.hf import CheckpointlessTrainer


@dataclass
class Fault:
    kind: str  # kill | raise
    where: str  # eval | save
    rank: int
    step: int
    mark: Path

    def due(self, where: str, rank: int, step: int) -> bool:
        return (where, rank, step) == (self.where, self.rank, self.step) and not self.mark.exists()

    def fire(self) -> None:
        self.mark.write_text(self.kind)
        print(f"fault in {self.where}: {self.kind} rank {self.rank} step {self.step}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"the {self.where} at step {self.step} failed once")


def parse_faults(spec: str, marks: str) -> list[Fault]:
    out = []
    for n, item in enumerate(s for s in spec.split(",") if s):
        kind, where, rank, step = item.split(":")
        out.append(Fault(kind, where, int(rank), int(step), Path(marks.replace("{n}", str(n)))))
    return out


class EvalFaults(TrainerCallback):
    """Fires an ``eval`` fault at the rank's second prediction step of the evaluation."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = [f for f in faults if f.where == "eval"]
        self.batches: dict[int, int] = {}

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for fault in self.faults:
            if fault.due("eval", args.process_index, state.global_step):
                self.batches[state.global_step] = self.batches.get(state.global_step, 0) + 1
                if self.batches[state.global_step] == 2:
                    fault.fire()


class LogFaults(TrainerCallback):
    """Fires a ``log`` fault as the evaluation's line reaches this callback, the last one (added
    after Trainer's printer): the line is shown already, a tracker after it would not have it."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = [f for f in faults if f.where == "log"]

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        for fault in self.faults:
            if "eval_loss" in (logs or {}) and fault.due("log", args.process_index, state.global_step):
                fault.fire()


class FaultyTrainer(CheckpointlessTrainer):
    """Fires a ``save`` fault between a checkpoint's weights and the rest of it."""

    faults: list[Fault] = []

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        for fault in self.faults:
            if fault.due("save", self.args.process_index, self.state.global_step):
                fault.fire()
        super()._save_optimizer_and_scheduler(output_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--record-batches", action="store_true")
    ap.add_argument("--data", help="unused (the test harness passes one)")
    ap.add_argument("--digest-out")
    args = ap.parse_args()

    faults = parse_faults(os.environ.get("HF_FAULTS", ""), os.environ.get("HF_FAULT_MARKS", "mark-{n}"))
    model = tiny_gpt2(args.seq_len, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        # the highest loss is the best: the first epoch's, so that loading it at the end changes
        # the weights (the loss falls every epoch here)
        greater_is_better=True,
        per_device_eval_batch_size=args.batch,
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    FaultyTrainer.faults = faults
    trainer = FaultyTrainer(
        model=model,
        args=training_args,
        train_dataset=Snippets(args.samples, args.seq_len, args.seed),
        eval_dataset=Snippets(8 * args.batch, args.seq_len, args.seed + 1),
        callbacks=[EvalFaults(faults)],
        record_batches=args.record_batches,
    )
    trainer.add_callback(LogFaults(faults))  # after the printer Trainer added last
    trainer.train()

    assert trainer.optimizer is not None
    rank = training_args.process_index
    out = os.environ.get("HF_EPOCH_OUT")
    if out:
        state = trainer.state
        best = state.best_model_checkpoint
        summary = {
            "evals": [e for e in without_timings(state.log_history) if "eval_loss" in e],
            "best_metric": state.best_metric,
            "best_global_step": state.best_global_step,
            "best_model_checkpoint": None if best is None else Path(best).name,
        }
        Path(out.replace("{rank}", str(rank))).write_text(json.dumps(summary, sort_keys=True))
    digest = state_digest(trainer.model, trainer.optimizer, trainer.state.log_history)
    write_digest(args.digest_out, rank, digest)


if __name__ == "__main__":
    main()
