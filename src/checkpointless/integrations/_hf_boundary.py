"""The protected section at a ``CheckpointlessTrainer`` step boundary: when it runs, and how it ends.

integrations/hf.py registers one section (evaluation, checkpoints, an epoch's end) that the step
loop asks about after every step (``when``, recovery/sections.py) and runs only where Trainer has
work: :func:`work_at`. Inside it Trainer's ``on_log`` calls are held (:class:`HeldLogs`) and
:func:`close_section` ends it on every rank together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from checkpointless.recovery.job import Job

__all__ = ["HeldLogs", "close_section", "ends_epoch", "work_at"]


def ends_epoch(at: int, steps_per_epoch: int, max_steps: int) -> bool:
    """The boundary after ``at`` steps ends an epoch, or training."""
    return at % steps_per_epoch == 0 or at >= max_steps


def work_at(control: Any, at: int, steps_per_epoch: int, max_steps: int) -> bool:
    """Trainer has work at the boundary after ``at`` steps: the evaluation or checkpoint its flags
    ask for after ``on_step_end``, an epoch's end (``on_epoch_end`` with its own), or a stop."""
    asked = control.should_evaluate or control.should_save or control.should_training_stop
    return bool(asked) or ends_epoch(at, steps_per_epoch, max_steps)


class HeldLogs:
    """Stands in for Trainer's callback handler while Trainer logs inside the boundary's section:
    the entry goes to the log history at once (what follows in the section reads it), its
    ``on_log`` (the printed line, a tracker's record) is held until every rank has done the
    section's work, so that a section redone after a fault shows its lines once."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float]) -> Any:
        control.should_log = False  # as the handler's own on_log does first
        self.logs.append(logs)
        return control


def close_section(
    job: Job, device: torch.device, held: HeldLogs, show: Callable[[dict[str, float]], None]
) -> None:
    """End the section's work on every rank together, then show its held log lines.

    The lines are shown once every rank has done the section's work: a fault in a checkpoint's
    save after the evaluation would otherwise show the evaluation twice. And no rank completes
    the section before every rank has done all of it: one failing after the section's last
    collective (in its checkpoint files, in ``on_log``) would leave its peers past the boundary
    while it redoes the section alone, its evaluation's gathers then meeting their step's
    all-reduce. Here they wait instead, are interrupted with it, and every rank redoes the
    section from the state it began with."""
    job.all_reduce(torch.zeros(1, device=device))
    for logs in held.logs:
        show(logs)
    job.all_reduce(torch.zeros(1, device=device))
