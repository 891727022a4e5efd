"""The step clock: where the loop is, and how long its steps take.

It is what each heartbeat tells the launcher (``protocol.Heartbeat``): the step running, the
age of the last progress (none while the loop has not started or a recovery runs, which are
timed by other rules; inside a section, which is judged by heartbeat silence only, 0), whether a
collective is waiting, and the last step's
time with and without its collective waits (the straggler rule's inputs). It also times the
step's batch: from the step's start to the model's first forward. :class:`StepClock` owns these
fields; the step loop moves it, the link's heartbeat thread reads it.
"""

from __future__ import annotations

import time

from checkpointless.protocol import Heartbeat

__all__ = ["StepClock"]


class StepClock:
    """The loop's position and timings, one per job."""

    def __init__(self) -> None:
        self.started = False  # job.steps() began
        self.recovering = False  # between a fault and the new generation's formation
        self.step_index: int | None = None  # the step begun last
        self.in_section: str | None = None  # the section running between steps, if any
        # degraded mode: the held data-parallel slot whose pass is running (None: the rank's
        # own), for the readers of per-slot data (job.loader(), job.generator())
        self.held_slot: int | None = None
        self.progress_t = time.monotonic()  # the last progress: a step begun or committed
        self.batch_s: float | None = None  # this step's time until its batch was in the model
        self.last_step_time: float | None = None
        self.last_busy_time: float | None = None  # the step less its collective waits
        self._waited_at_step = 0.0  # the communicator's wait total as the step began

    def begin(self, index: int, waited_s: float) -> None:
        """Step ``index`` begins; ``waited_s``: the communicator's collective waits so far."""
        self.step_index = index
        self.progress_t = time.monotonic()
        self._waited_at_step = waited_s
        self.batch_s = None

    def commit(self, waited_s: float) -> None:
        """The step committed: its time, and its time less the collective waits in it."""
        now = time.monotonic()
        self.last_step_time = now - self.progress_t
        self.last_busy_time = max(0.0, self.last_step_time - (waited_s - self._waited_at_step))
        self.progress_t = now

    def restart(self) -> None:
        """Progress now (a section ended, a new generation formed): the hang clock restarts."""
        self.progress_t = time.monotonic()

    def first_forward(self) -> None:
        """The step's start to the model's first forward: fetching and assembling the batch (and
        moving it to the device), measured without asking the script to report it."""
        if self.batch_s is None:
            self.batch_s = time.monotonic() - self.progress_t

    def inside(self, committed_step: int) -> bool:
        """Inside the step the loop is at (not between steps, nor in a section after it)."""
        return self.step_index is not None and self.step_index == committed_step

    def heartbeat(self, in_collective_since: float | None) -> Heartbeat:
        return Heartbeat(
            step=self.step_index,
            progress_age=self._progress_age(),
            in_collective=in_collective_since is not None,
            step_time=self.last_step_time,
            busy_time=self.last_busy_time,
        )

    def _progress_age(self) -> float | None:
        """The age of the last progress, as the launcher's hang rule reads it. None (the launcher
        keeps the last age it had) while recovering, which the launcher times by its own rules,
        and before the loop. Inside a section, 0: progress now. A section is judged by heartbeat
        silence only, for it may be long (an evaluation; one rank's save while its peers wait at
        the barrier that closes it), and None would leave the launcher the step's age, which
        grows through the section until a rank working in it is taken for hung."""
        if self.recovering or not self.started:
            return None
        if self.in_section is not None:
            return 0.0
        return time.monotonic() - self.progress_t
