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
commit; the next step belongs to the next epoch, and the inner loop returns then.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from checkpointless.errors import ConfigError

__all__ = ["EpochDriver"]


class EpochDriver:
    """Splits the steps of ``job.steps()`` into epochs of ``per_epoch`` steps."""

    def __init__(self, steps: Iterator[Any], per_epoch: int) -> None:
        self._steps = steps
        self.per_epoch = per_epoch
        self._pending: Any = None  # the step the next inner loop starts with
        self._carried: Any = None  # a step of the next epoch that ended an inner loop

    def epochs(self) -> Iterator[int]:
        try:
            step = next(self._steps, None)  # the start round runs here: a replacement is placed
            while step is not None:
                self._pending = step
                yield step.index // self.per_epoch
                if self._pending is step:
                    raise ConfigError(
                        "an epoch of job.epochs() ran none of its steps: inside the epoch loop, run "
                        "`for step in job.epoch_steps(): with step: ...`"
                    )
                step, self._carried = self._carried, None
                if step is None:  # after the epoch's last commit: the per-epoch work has run
                    step = next(self._steps, None)
        finally:
            # `break` out of the epoch loop: job.steps() ends the job cleanly at the last commit
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()

    def epoch_steps(self) -> Iterator[Any]:
        step, self._pending = self._pending, None
        if step is None:
            raise ConfigError("job.epoch_steps() runs once per epoch, inside `for epoch in job.epochs(...)`")
        epoch = step.index // self.per_epoch
        while True:
            yield step
            if step.committed and step.index % self.per_epoch == self.per_epoch - 1:
                return  # the epoch is complete: its per-epoch work runs before the next step
            step = next(self._steps, None)
            if step is None:
                return  # the job ended (job.stop()), inside this epoch
            if step.index // self.per_epoch != epoch:
                self._carried = step  # rolled forward past the epoch's last step
                return
