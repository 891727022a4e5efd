"""The protected section at a ``CheckpointlessTrainer`` step boundary: when it runs, and how it ends.

integrations/hf.py registers one section (evaluation, checkpoints, an epoch's end) that the step
loop asks about after every step (``when``, recovery/sections.py) and runs only where Trainer has
work: :func:`work_at`. Inside it Trainer's ``on_log`` calls are held (:class:`HeldLogs`); they
are shown once the step loop has closed the section on every rank together (``close_section``,
recovery/driver.py, then the section's ``closed``), when no fault can make it run again. What
is held is kept outside the process too (:class:`ClosingLines`, recovery/held_lines.py), so the
replacement of a rank lost before it showed them shows them.
"""

from __future__ import annotations

import json
from typing import Any

from checkpointless.events import get_logger
from checkpointless.integrations._hf_internals import log_to

__all__ = ["ClosingLines", "HeldLogs", "ends_epoch", "work_at"]

log = get_logger()


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
    ``on_log`` (the printed line, a tracker's record) is held until the section has closed on
    every rank, so that a section redone after a fault shows its lines once. A fault anywhere in
    the section, up to the last rank's arrival at the closing barrier, redoes it on every rank:
    lines shown before then could be shown twice."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        # how far show() has come: the entry being shown, and how many callbacks have had it
        self.entry = 0
        self.reached = 0

    def show(self, handler: Any, args: Any, state: Any, control: Any) -> Any:
        """Give each held entry to each of ``handler``'s callbacks in turn (the handler's
        ``on_log``, one callback at a time) and return the control flags. Called again after a
        callback raised (the step loop recovers it, recovery/driver.py), it goes on from that
        callback with that entry: the callbacks before it (Trainer's printer, a tracker) have
        had it already and do not get it twice."""
        while self.entry < len(self.logs):
            callbacks = list(handler.callbacks)
            while self.reached < len(callbacks):
                control = log_to(
                    handler, callbacks[self.reached], args, state, control, self.logs[self.entry]
                )
                self.reached += 1
            self.entry, self.reached = self.entry + 1, 0
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float]) -> Any:
        control.should_log = False  # as the handler's own on_log does first
        self.logs.append(logs)
        return control

    def encode(self) -> bytes | None:
        """The entries not shown yet, as JSON (Trainer's log values are numbers and strings);
        None when there are none, or when one is not JSON (then it is not kept)."""
        rest = self.logs[self.entry :]
        if not rest:
            return None
        try:
            return json.dumps(rest).encode()
        except (TypeError, ValueError) as e:
            log.warning("held log lines not kept for a replacement (not JSON: %s)", e)
            return None

    @classmethod
    def decode(cls, data: bytes) -> HeldLogs:
        """The entries :meth:`encode` wrote, none shown yet."""
        held = cls()
        held.logs = [dict(entry) for entry in json.loads(data)]
        return held


class ClosingLines:
    """The boundary section's lines to show as it closes (``logs``, set by its last attempt),
    kept for a replacement as the section's ``held`` (recovery/sections.py)."""

    def __init__(self) -> None:
        self.logs: HeldLogs | None = None

    def encode(self) -> bytes | None:
        return self.logs.encode() if self.logs is not None else None

    def restore(self, data: bytes) -> None:
        self.logs = HeldLogs.decode(data)
