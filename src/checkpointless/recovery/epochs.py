"""Epoch-shaped loops over the job's one step loop: ``job.epochs()`` and ``job.epoch_steps()``.

Training scripts are written as two loops, epochs outside and batches inside, with per-epoch work
(a snapshot, an evaluation pass, a print) after the inner loop. Rewriting that as one flat loop
over steps moves the per-epoch work into an ``if`` at the end of every step, which is most of
an adoption's changed lines. So the same shape is offered::

    for epoch in job.epochs(max_epochs, dataloader, start=epochs_run):   # was: range(...)
        for step in job.epoch_steps():                                    # was: for batch in dl
            with step:
                train_on(*step.batch)
        ...per-epoch work, unchanged...

Both are views of the one ``job.steps()`` generator, which still does all the work (the start
round, recoveries, the final barrier). The outer loop yields the epoch of the next step; the inner
one yields that epoch's steps and returns right after the epoch's last step commits, *before*
asking ``job.steps()`` for another step, so the per-epoch work runs between steps as it did in the
flat loop, and a ``break`` out of the outer loop after it leaves at a committed step (a clean end).

A replacement's outer loop starts at the epoch of the step it resumes at, and its inner loop at
that step, so its per-epoch work runs at the same epochs as its peers'. A rank whose interrupted
last step of an epoch was rolled forward by a recovery (its update applied) never sees that step
commit; the next step belongs to the next epoch, and the inner loop returns then, so it runs that
epoch's per-epoch work as it leaves the recovery. It sent its state to a replacement *before*
that (inside the recovery), so the state says which epochs' work had run (``LoopControl.
epochs_done``): a replacement whose first step begins an epoch while the previous epoch's work
has not run first gets that epoch with no steps, and runs its work too. A scheduler stepped
after each epoch thus steps as often on the replacement as on its peers.

A recovery that rolls back to an earlier epoch (a snapshot, when no replica held the state)
leaves the inner loop of an epoch that did not finish, and the code after it runs as the inner
loop returns: the script's loops cannot skip it. So the driver holds the restored state (a copy
in host memory, taken as the rollback returns) and puts it back once that code has run, before
the earlier epoch is replayed: the abandoned epoch's work then changes nothing that is tracked
(the scheduler, the loop's count of epochs, the generators). What it did outside the tracked
state (a line printed, a file written) stays done; code that should not run for an abandoned
epoch (an evaluation that may ``break``, a file) can ask ``job.epoch_abandoned``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.recovery.loop import LoopControl
from checkpointless.state.snapshot import (
    Stateful,
    capture_rng,
    collect_state,
    host_copy,
    land,
    landing_zone,
    restore_rng,
    restore_state,
)

__all__ = ["EpochDriver", "hold_state"]

_NO_STEPS = object()  # the pending "step" of an epoch whose inner loop has nothing left to run


class EpochDriver:
    """Splits the steps of ``job.steps()`` into epochs of ``per_epoch`` steps. ``loop`` is the
    job's loop state, which travels with the training state; ``start_epoch`` the first epoch."""

    def __init__(
        self,
        steps: Iterator[Any],
        per_epoch: int,
        loop: LoopControl | None = None,
        start_epoch: int = 0,
        hold: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        self._steps = steps
        self.per_epoch = per_epoch
        # hold(): copy the tracked state now and return what puts the copy back (hold_state)
        self._hold = hold
        self._put_back: Callable[[], None] | None = None  # after a rollback's abandoned epoch
        self.abandoned = False  # the last inner loop ended in a rollback to an earlier epoch
        self._pending: Any = None  # the step the next inner loop starts with
        self._carried: Any = None  # a step of the next epoch that ended an inner loop
        self._loop = loop if loop is not None else LoopControl()
        # before the start round: the epochs before the first ran in an earlier job (or none); a
        # replacement's join then replaces this with its peers' count
        self._loop.epochs_done = start_epoch - 1

    def epochs(self) -> Iterator[int]:
        try:
            step = next(self._steps, None)  # the start round runs here: a replacement is placed
            if step is not None and step.index % self.per_epoch == 0:
                behind = step.index // self.per_epoch - 1
                if self._loop.epochs_done < behind:
                    # placed at an epoch's first step by a recovery that rolled the previous
                    # epoch's last step forward: its peers run that epoch's work as they leave
                    # the recovery, after they sent this state, so it runs it too
                    self._pending, self._carried = _NO_STEPS, step
                    yield from self._epoch(behind)
                    step, self._carried = self._carried, None
            while step is not None:
                self._pending = step
                yield from self._epoch(step.index // self.per_epoch)
                if self._put_back is not None:  # the abandoned epoch's work ran: undo it
                    self._put_back()
                    self._put_back = None
                self.abandoned = False  # the next epoch (the replayed one) is not abandoned
                step, self._carried = self._carried, None
                if step is None:  # after the epoch's last commit: the per-epoch work has run
                    step = next(self._steps, None)
        finally:
            # `break` out of the epoch loop: job.steps() ends the job cleanly at the last commit
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()

    def _epoch(self, epoch: int) -> Iterator[int]:
        yield epoch
        if self._pending is not None:
            raise ConfigError(
                "an epoch of job.epochs() ran none of its steps: inside the epoch loop, run "
                "`for step in job.epoch_steps(): with step: ...`"
            )
        self._loop.epochs_done = epoch  # its per-epoch work has run

    def epoch_steps(self) -> Iterator[Any]:
        step, self._pending = self._pending, None
        if step is None:
            raise ConfigError("job.epoch_steps() runs once per epoch, inside `for epoch in job.epochs(...)`")
        self.abandoned = False
        if step is _NO_STEPS:
            return
        epoch = step.index // self.per_epoch
        while True:
            yield step
            if step.committed and step.index % self.per_epoch == self.per_epoch - 1:
                return  # the epoch is complete: its per-epoch work runs before the next step
            step = next(self._steps, None)
            if step is None:
                return  # the job ended (job.stop()), inside this epoch
            if step.index // self.per_epoch != epoch:
                # rolled forward past the epoch's last step, or back to an earlier epoch
                self._carried = step
                if step.index // self.per_epoch < epoch:
                    self.abandoned = True
                    if self._hold is not None:
                        self._put_back = self._hold()
                return


def hold_state(objects: dict[str, Stateful], committed: Callable[[], int]) -> Callable[[], None]:
    """Copy the job's tracked ``objects`` and the generators to host memory; return what restores
    them (the ``hold`` of the job's :class:`EpochDriver`: after a rollback to an earlier epoch).
    ``committed`` reads the job's committed step. Rare, so a plain copy."""
    held = host_copy(collect_state(objects, committed(), capture_rng()))

    def put_back() -> None:
        # into the live tensors, as a received state lands: no second copy on the device
        own = landing_zone(objects, committed(), capture_rng())
        _, rng = restore_state(objects, land(held, own))
        restore_rng(rng)

    return put_back
