"""One step of ``job.steps()``: a context manager whose block commits when it ends cleanly and
hands an exception to the recovery instead of raising it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointless.recovery.commit import check_divergence, commit, enter_step
from checkpointless.recovery.recover import recover_from

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = ["Step"]


class Step:
    """One training step; use as a context manager around the step's body."""

    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.index = index
        self.committed = False
        self.entered = False  # job.steps() refuses a step whose body ran outside `with step:`

    @property
    def epoch(self) -> int:
        """The epoch this step belongs to (``steps_per_epoch`` of job.steps(), or its loader's)."""
        return self.index // self.job._per_epoch()

    @property
    def index_in_epoch(self) -> int:
        """The step's place inside its epoch, from 0."""
        return self.index % self.job._per_epoch()

    @property
    def batch(self) -> Any:
        """This step's batch (the same object in a replay), from job.epochs()' loader or the one
        job.loader(); read it inside ``with step:``."""
        return self.job._batch(self.index)

    def __enter__(self) -> Step:
        self.entered = True
        enter_step(self.job, self.index)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            commit(self.job, self.index)
            self.committed = True
            check_divergence(self.job)
            return False
        if not isinstance(exc, Exception) or self.job._link is None:
            return False  # KeyboardInterrupt/SystemExit, or no launcher to recover with
        recover_from(self.job, self.index, exc)
        return True
