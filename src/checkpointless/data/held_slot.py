"""Which data-parallel slot's batch a :class:`~checkpointless.data.BatchLoader` serves right now.

Degraded mode (docs/fault-model.md): a process that holds a lost rank's slot trains that slot's
micro-batch in an extra pass of each step. A script builds its ``BatchLoader`` for its own share
(``dp_rank=job.rank``) and calls ``loader.batch(step.index)`` in every pass; without help, the
held slot's pass would train the holder's own share a second time, silently. So the job tells
the data layer, here, which held slot's pass is running, and a loader built for the job's own
share serves that slot's share in it. Kept apart from loader.py so that the job can say so
without the data layer's torch imports, and the data layer never imports the recovery's.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["follow_job", "held_slot_for"]


class _JobShare:
    """The job's own data-parallel share, and where the running pass's held slot is read."""

    def __init__(self) -> None:
        self.rank = -1
        self.world_size = 0
        self.held_slot: Callable[[], int | None] | None = None


_JOB = _JobShare()


def follow_job(rank: int, world_size: int, held_slot: Callable[[], int | None]) -> None:
    """Called by the job once it has its rank: ``held_slot()`` is the held slot whose pass is
    running, None in this rank's own pass and between steps."""
    _JOB.rank, _JOB.world_size, _JOB.held_slot = rank, world_size, held_slot


def held_slot_for(dp_rank: int, dp_size: int) -> int | None:
    """The held slot whose share a loader of share ``(dp_rank, dp_size)`` serves now, or None:
    only a loader of the job's own share follows the passes (a loader of another share, such
    as a spare's prefetcher, serves the share it was built for)."""
    if _JOB.held_slot is None or (dp_rank, dp_size) != (_JOB.rank, _JOB.world_size):
        return None
    return _JOB.held_slot()
