"""The step record: what this rank remembers of the step (or section) it is running.

Each step begins with its generators captured (a replay, or the state sent to a replacement,
starts from them), an empty set of fields for its ``commit`` event (``job.record()``), and the
per-rank streams of ``job.generator()`` reset. A fault inside it remembers which step it
interrupted and what it had recorded, so that a recovery which rolls that step forward can still
emit its commit; an exception counts towards the step's retries. :class:`StepRecord` owns these
fields and the commit log the events go to (``commit_log.py``, set when the rank is assigned);
the step loop, the commit and the recovery round update it through its methods.
"""

from __future__ import annotations

from typing import Any

from checkpointless.events import EventLog
from checkpointless.recovery.rng import StepStreams
from checkpointless.state.snapshot import RngState, capture_rng

__all__ = ["StepRecord"]


class StepRecord:
    """The running step's event fields, starting generators, retries and interruption."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}  # job.record(): extra fields of this step's commit event
        # (step, the generators as it began here): where a replay or a replacement starts from
        self.rng_at_start: tuple[int, RngState] | None = None
        self.retries: dict[int, int] = {}  # step -> exceptions it raised in a row on this rank
        # (step, its fields) of the step a fault interrupted, until the recovery settles it
        self.interrupted: tuple[int, dict[str, Any]] | None = None
        self.events: EventLog | None = None  # the commit log (under the launcher)
        self.streams = StepStreams()  # job.generator()'s per-rank streams
        # degraded mode: the fields each pass recorded, by slot, until the step commits: the
        # own pass's go to this rank's commit, a held slot's to a ``slot_commit`` event
        self._passes: dict[int, dict[str, Any]] = {}

    def begin(self, index: int) -> RngState:
        """Step ``index`` begins: its fields cleared, its generators captured (returned)."""
        self.fields = {}
        self._passes = {}
        rng = capture_rng()
        self.rng_at_start = (index, rng)
        self.streams.begin_step()
        return rng

    def begin_section(self, at: int) -> None:
        """A section begins at the boundary after ``at`` steps: a fault inside it redoes it from
        the generators as they are now."""
        self.rng_at_start = (at, capture_rng())
        self.fields = {}
        self.streams.begin_step()  # job.generator() in a section: each attempt from its start

    def end_section(self, at: int, rng: RngState) -> None:
        """The section at the boundary after ``at`` steps has closed on every rank, leaving the
        generators at ``rng``: a fault before the next step begins resumes from them (the
        section is not redone), not from where the section began."""
        self.rng_at_start = (at, rng)

    def emit(self, event: str, **fields: Any) -> None:
        """Write an event (with this step's recorded fields) to the commit log, if there is one."""
        if self.events is not None:
            self.events.emit(event, **fields, **self.fields)

    def end_pass(self, slot: int) -> None:
        """A pass of a degraded step ended cleanly: what it recorded is ``slot``'s; the next
        pass records afresh."""
        self._passes[slot] = self.fields
        self.fields = {}

    def take_passes(self, own: int) -> dict[int, dict[str, Any]]:
        """As a degraded step commits (after :meth:`end_pass` of its last pass): this rank's own
        pass's fields become the commit's again; the held slots' are returned, by slot."""
        held = self._passes
        self.fields = held.pop(own, self.fields)
        self._passes = {}
        return held

    def emit_held(self, index: int, generation: int, held: dict[int, dict[str, Any]], by: int) -> None:
        """Each held slot's ``slot_commit`` event for step ``index``: what its pass recorded
        (``job.record``), as its own rank's commit would have carried it at full width."""
        if self.events is None:
            return
        for slot, fields in sorted(held.items()):
            self.events.emit("slot_commit", step=index, generation=generation, slot=slot, by=by, **fields)

    def count_retry(self, index: int) -> int:
        """Step ``index`` raised once more on this rank: how many times in a row it has."""
        self.retries[index] = self.retries.get(index, 0) + 1
        return self.retries[index]

    def interrupt(self, index: int) -> None:
        """A fault interrupted step ``index``: remember it with what it had recorded. In a
        degraded step that is the rank's own pass's (the first that ended), not what a held
        slot's pass recorded before it was cut off: a rolled-forward commit is the rank's."""
        own = next(iter(self._passes.values()), self.fields)
        self.interrupted = (index, dict(own))

    def rng_for(self, target: int) -> RngState:
        """The generators as step ``target`` first began here; if this rank never began it (it
        finished the step before), its current state is that state."""
        if self.rng_at_start is not None and self.rng_at_start[0] == target:
            return self.rng_at_start[1]
        return capture_rng()

    def settle(self, target: int, generation: int) -> None:
        """A recovery resumes at ``target``: if the interrupted step was ``target - 1`` its update
        was applied (here or on the replica received), so its batch was trained on and it is
        committed, not replayed; then the step's record is cleared."""
        self.rng_at_start = None
        if self.interrupted is not None and self.interrupted[0] == target - 1 and self.events is not None:
            index, record = self.interrupted
            self.events.emit("commit", step=index, generation=generation, rolled_forward=True, **record)
        self.interrupted = None
