"""Where a rank's ``CheckpointlessTrainer`` loop stands: the state of integrations/hf.py's loop
that is this process's own (not part of the replica), as typed records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from checkpointless.integrations._hf_state import StepPlan
from checkpointless.recovery.job import Step

__all__ = ["EvalContext", "StepOut", "TrainerRun"]


@dataclass
class StepOut:
    """What a step computed, kept by the step's caller so a rank rolled forward still has it."""

    loss: float | None = None  # the ranks' mean loss (summed over micro-batches)
    flos: float = 0.0
    grad_norm: float | None = None
    learning_rate: float | None = None


@dataclass
class EvalContext:
    """What Trainer passes its evaluation and checkpoint code, as of the running epoch."""

    model: nn.Module | None = None
    trial: Any = None
    ignore_keys: list[str] | None = None
    start_time: float | None = None


@dataclass
class TrainerRun:
    """Where this rank's training loop stands in the job."""

    steps: Any  # the job.steps() generator
    plan: StepPlan
    loader: Any  # job.loader() over the training DataLoader
    pending: Step | None = None  # taken from the generator, not yet run
    done: bool = False  # the generator ended
    held: tuple[int, list[Any]] | None = None  # the step whose micro-batches are held, for a replay
    begun: int = -1  # the last step on_step_begin ran for (a replay does not run it again)
    booked: int = -1  # the last step whose bookkeeping (on_step_end, log) ran on this rank
    last_out: StepOut = field(default_factory=StepOut)  # the newest attempt's results
    joining: bool = False  # a replacement receiving its state: the boundary's bookkeeping is done
    resumed_at: int = -1  # resume_from_checkpoint's step: its boundary was handled before the save
