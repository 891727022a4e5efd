"""One step of ``job.steps()``: a context manager whose block commits when it ends cleanly and
hands an exception to the recovery instead of raising it. It also knows its epoch and its batch,
from the job's ``steps_per_epoch`` or its one loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointless.errors import ConfigError
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
        return self.index // _per_epoch(self.job)

    @property
    def index_in_epoch(self) -> int:
        """The step's place inside its epoch, from 0."""
        return self.index % _per_epoch(self.job)

    @property
    def batch(self) -> Any:
        """This step's batch (the same object in a replay), from job.epochs()' loader or the one
        job.loader(); read it inside ``with step:``."""
        return _batch(self.job, self.index)

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
        if not isinstance(exc, Exception) or not self.job.recovery.connected:
            return False  # KeyboardInterrupt/SystemExit, or no launcher to recover with
        recover_from(self.job, self.index, exc)
        return True


def _per_epoch(job: Job) -> int:
    if job._steps_per_epoch is not None:
        return job._steps_per_epoch
    if len(job.tracked.loaders) == 1 and job.tracked.loaders[0].batches_per_epoch:
        return job.tracked.loaders[0].batches_per_epoch
    raise ConfigError(
        f"step.epoch needs the epoch length: pass job.steps(total, steps_per_epoch=N) (this job "
        f"has {len(job.tracked.loaders)} job.loader()s, so the length is not implied)"
    )


def _batch(job: Job, index: int) -> Any:
    loader = job._step_loader or (job.tracked.loaders[0] if len(job.tracked.loaders) == 1 else None)
    if loader is None:
        raise ConfigError(
            f"step.batch needs one loader, and this job has {len(job.tracked.loaders)} job.loader()s; "
            "call loader.batch(step.index) on the one you mean"
        )
    return loader.batch(index)
