"""Pure bookkeeping for the Lightning strategy: where a rank stands against the job's step.

Lightning owns the training loop, so the strategy cannot move the loop to a step; it can only
decide, for each batch Lightning hands it, whether to train on it, skip it (a replacement that
received a replica's state is behind in Lightning's loop) or leave the job (its loop is past the
state: every replica was lost and an older snapshot restored; a spare with a fresh loop, put at
that step, takes the rank). These rules are kept here, free of Lightning and torch,
so they are tested as plain functions.
"""

from __future__ import annotations

import enum
import importlib.metadata
import warnings
from dataclasses import dataclass, field
from typing import Any

from checkpointless.errors import CheckpointlessError

__all__ = [
    "TESTED_LIGHTNING",
    "BatchAction",
    "LoopAheadOfState",
    "PlateauMetrics",
    "SchedulerLedger",
    "batch_action",
    "warn_if_untested",
]

# The Lightning release the strategy is tested against (tests/unit/integrations/test_lightning_unit.py pins it);
# it uses only public hooks, but Lightning's loop order is what makes them mean what they mean.
TESTED_LIGHTNING = "2.6.6"


def warn_if_untested(strategy: str) -> None:
    """Warn (at the caller's caller: the script that made ``strategy``) when the installed
    lightning is not the one the integration is tested with."""
    installed = importlib.metadata.version("lightning")
    if installed != TESTED_LIGHTNING:
        warnings.warn(
            f"{strategy} is tested with lightning=={TESTED_LIGHTNING}, this is {installed}; "
            "install the `checkpointless[lightning]` extra for the tested pair",
            stacklevel=3,
        )


class LoopAheadOfState(CheckpointlessError):
    """A rank's Lightning loop is past the state it holds (the job went back to a snapshot or a
    checkpoint): not a setting, so not a ``ConfigError``; the process exits and is replaced."""


class BatchAction(enum.Enum):
    TRAIN = "train"  # the batch is the job's next step: run it inside a checkpointless Step
    SKIP = "skip"  # the replica state this rank holds already includes this batch's update


def batch_action(lightning_step: int, job_step: int) -> BatchAction:
    """What to do with the batch Lightning is about to step on.

    ``lightning_step`` is ``trainer.global_step`` (optimizer steps Lightning has completed);
    ``job_step`` is the job's committed step (updates in this rank's state). A replacement joins
    with a replica's state, so its job step is ahead until Lightning's loop has walked through
    the batches that state already contains; the loop can never be ahead of the state.
    """
    if lightning_step < job_step:
        return BatchAction.SKIP
    if lightning_step == job_step:
        return BatchAction.TRAIN
    raise LoopAheadOfState(
        f"Lightning is at optimizer step {lightning_step} but this rank's state holds only "
        f"{job_step} updates: every replica was lost and the job restored an older snapshot or "
        "checkpoint, and the strategy cannot move a running Lightning loop back. This process "
        "leaves so that a spare takes its rank and puts a fresh loop at that step (keep a hot "
        "spare per rank, `--spares`, for a job whose every replica may be lost at once)."
    )


@dataclass
class SchedulerLedger:
    """Which scheduler calls each scheduler has had, so that a call is never applied twice.

    Lightning steps schedulers after the optimizer step, outside the strategy. A rank that
    received a replica's state already has the replica's scheduler; the calls Lightning then makes
    for batches that state already covers must be dropped. ``marks[i]`` is the position
    (``global_step`` for interval "step", epochs finished for "epoch") of scheduler i's last call.
    It is tracked with the model, so it travels with the scheduler it describes.
    """

    marks: dict[str, int] = field(default_factory=dict)

    def should_step(self, key: str, mark: int) -> bool:
        """Record and allow the call at ``mark`` unless the state already contains it."""
        if self.marks.get(key, -1) >= mark:
            return False
        self.marks[key] = mark
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"marks": dict(self.marks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.marks = {str(k): int(v) for k, v in state["marks"].items()}


class PlateauMetrics:
    """The metrics the fit's ``ReduceLROnPlateau`` schedulers monitor, as this rank's
    ``trainer.callback_metrics`` holds them, as part of the replica. Lightning steps such a
    scheduler on the last value logged, which may be a validation's before step C (validating
    every 2 batches, stepping every 3): an uninterrupted rank has it, and a replacement that seeks
    runs no validation before C (one that walks runs them with C's weights, another value). It
    gets the sender's; a rank that has trained keeps its own (only missing keys are filled)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._keys = [cfg.monitor for cfg in trainer.lr_scheduler_configs if cfg.reduce_on_plateau]

    def state_dict(self) -> dict[str, Any]:
        metrics = self._trainer.callback_metrics
        return {k: metrics[k].detach().clone() for k in self._keys if k in metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        metrics = self._trainer.callback_metrics
        for k, v in state.items():
            metrics.setdefault(k, v.clone())
