"""The loop's schedule: what the script told the job about the shape of its loop.

The sections registered with ``job.section()`` (run between steps, ``sections.py``), the epoch
length (``job.steps(steps_per_epoch=N)``, or implied by the one ``job.loader()``) and the loader
whose batches ``step.batch`` returns (``job.epochs()``'s). :class:`StepSchedule` owns them;
``Step`` asks it for a step's epoch and batch, the step loop for the sections due.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.sections import HeldLines, Section
from checkpointless.recovery.stateful_loader import StatefulStepLoader

__all__ = ["StepSchedule"]

Loader = StepLoader | StatefulStepLoader


class StepSchedule:
    """Sections, the epoch length and ``step.batch``'s loader."""

    def __init__(self) -> None:
        self.sections: list[Section] = []  # in registration order
        self.steps_per_epoch: int | None = None  # job.steps(steps_per_epoch=...)
        self.step_loader: Loader | None = None  # job.epochs()' loader, read by step.batch

    def add_section(
        self,
        name: str,
        fn: Callable[[], Any],
        every: int,
        at_start: bool,
        when: Callable[[], bool] | None = None,
        closed: Callable[[], None] | None = None,
        held: HeldLines | None = None,
    ) -> None:
        """Register a section (``job.section()``, or an integration's with ``when``, ``closed``
        and ``held``, sections.py); its name must be new."""
        if any(s.name == name for s in self.sections):
            raise ConfigError(f"a section named {name!r} is already registered; give each its own name")
        self.sections.append(Section(name, fn, every, at_start, when, closed, held))

    def per_epoch(self, loaders: Sequence[Loader]) -> int:
        """The epoch length: ``steps_per_epoch``, else that of the job's one loader."""
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch
        if len(loaders) == 1 and loaders[0].batches_per_epoch:
            return loaders[0].batches_per_epoch
        raise ConfigError(
            f"step.epoch needs the epoch length: pass job.steps(total, steps_per_epoch=N) (this job "
            f"has {len(loaders)} job.loader()s, so the length is not implied)"
        )

    def batch(self, index: int, loaders: Sequence[Loader]) -> Any:
        """Step ``index``'s batch from ``job.epochs()``' loader, else from the job's one loader."""
        loader = self.step_loader or (loaders[0] if len(loaders) == 1 else None)
        if loader is None:
            raise ConfigError(
                f"step.batch needs one loader, and this job has {len(loaders)} job.loader()s; "
                "call loader.batch(step.index) on the one you mean"
            )
        return loader.batch(index)
