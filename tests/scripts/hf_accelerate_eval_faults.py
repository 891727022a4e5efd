"""examples/hf_accelerate.py with a fault in the middle of one of its evaluations.

``HF_EVAL_FAULT=KIND:RANK:STEP`` (KIND ``kill`` or ``raise``): while the loop evaluates after
STEP optimizer steps, rank RANK is SIGKILLed, or raises once, as it reads its second evaluation
sample. The file ``HF_EVAL_MARK`` records that the fault fired, so that no process (the rank
itself after a raise, its replacement after a kill) fires it again.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_accelerate
import torch
from _hf_common import Snippets

import checkpointless

EVAL_SEED_OFFSET = 1  # the example's held-out data is Snippets(..., seed + 1)


class FaultyHeldOut(Snippets):
    """The example's data; reading the held-out samples fires the fault once."""

    reads = 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        spec, mark = os.environ.get("HF_EVAL_FAULT"), Path(os.environ["HF_EVAL_MARK"])
        if spec and self.seed == 1234 + EVAL_SEED_OFFSET and not mark.exists():
            kind, rank, step = spec.split(":")
            job = checkpointless.init()  # the job the accelerator joined (init() returns it again)
            if job.rank == int(rank) and job.committed_step == int(step):
                FaultyHeldOut.reads += 1
                if FaultyHeldOut.reads == 2:
                    mark.write_text(kind)
                    print(f"fault in evaluation: {kind} rank {rank} step {step}", flush=True)
                    if kind == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError("an evaluation sample failed once")
        return super().__getitem__(i)


if __name__ == "__main__":
    hf_accelerate.Snippets = FaultyHeldOut  # type: ignore[misc]
    hf_accelerate.main()
