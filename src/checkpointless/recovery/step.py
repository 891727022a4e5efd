"""One step of ``job.steps()``: a context manager whose block commits when it ends cleanly and
hands an exception to the recovery instead of raising it. It also knows its epoch and its batch,
from the job's schedule (``schedule.py``: ``steps_per_epoch`` or its one loader).
"""

from __future__ import annotations

from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.recovery.commit import check_divergence, commit, enter_step
from checkpointless.recovery.member import Member
from checkpointless.recovery.recover import recover_from

__all__ = ["Step"]


class Step:
    """One training step; use as a context manager around the step's body.

    ``index`` is the step being run (a replay runs the same index again), ``committed`` whether
    its block ended cleanly (check it after the ``with`` block)."""

    def __init__(self, member: Member, index: int) -> None:
        self._member = member
        self.index = index
        self.committed = False
        self.entered = False  # job.steps() refuses a step whose body ran outside `with step:`

    @property
    def epoch(self) -> int:
        """The epoch this step belongs to (``steps_per_epoch`` of job.steps(), or its loader's)."""
        return self.index // self._member.schedule.per_epoch(self._member.tracked.loaders)

    @property
    def index_in_epoch(self) -> int:
        """The step's place inside its epoch, from 0."""
        return self.index % self._member.schedule.per_epoch(self._member.tracked.loaders)

    @property
    def batch(self) -> Any:
        """This step's batch (the same object in a replay), from job.epochs()' loader or the one
        job.loader(); read it inside ``with step:``."""
        return self._member.schedule.batch(self.index, self._member.tracked.loaders)

    def __enter__(self) -> Step:
        self.entered = True
        enter_step(self._member, self.index)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            commit(self._member, self.index)
            self.committed = True
            check_divergence(self._member)
            return False
        if not isinstance(exc, Exception) or not self._member.recovery.connected:
            return False  # KeyboardInterrupt/SystemExit, or no launcher to recover with
        if isinstance(exc, ConfigError):
            return False  # a replay would raise it again: it ends the script (run_script.py)
        recover_from(self._member, self.index, exc)
        return True
