"""examples/hf_trainer.py with a fault in the middle of one of Trainer's evaluations.

``HF_EVAL_FAULT=KIND:RANK:STEP`` (KIND ``kill`` or ``raise``): while Trainer evaluates after
optimizer step STEP (``state.global_step == STEP``), rank RANK is SIGKILLed, or raises once, at
its second evaluation batch; the file ``HF_EVAL_MARK`` records that it fired, so that no process
(the rank itself after a raise, its replacement after a kill) fires it again. Every rank also writes the evaluation entries of its log history to
``HF_EVAL_OUT`` ({rank} filled in) at the end, for the test to compare with the fault-free run's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from _hf_common import without_timings
from hf_trainer import main
from transformers import TrainerCallback


class EvalFault(TrainerCallback):
    """The fault, fired once by this process at the second prediction step of its evaluation."""

    def __init__(self, spec: str, mark: Path) -> None:
        kind, rank, step = spec.split(":")
        self.kind, self.rank, self.step = kind, int(rank), int(step)
        self.mark = mark
        self.batches = 0

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.mark.exists() or state.global_step != self.step or args.process_index != self.rank:
            return
        self.batches += 1
        if self.batches == 2:
            self.mark.write_text(self.kind)
            print(f"fault in evaluation: {self.kind} rank {self.rank} step {self.step}", flush=True)
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("an evaluation batch failed once")


def run() -> None:
    spec = os.environ.get("HF_EVAL_FAULT")
    trainer = main([EvalFault(spec, Path(os.environ["HF_EVAL_MARK"]))] if spec else [])
    out = os.environ.get("HF_EVAL_OUT")
    if out:
        evals = [e for e in without_timings(trainer.state.log_history) if "eval_loss" in e]
        path = Path(out.replace("{rank}", str(trainer.args.process_index)))
        path.write_text(json.dumps(evals, sort_keys=True))


if __name__ == "__main__":
    run()
