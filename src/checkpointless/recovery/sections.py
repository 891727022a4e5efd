"""Protected sections: evaluation (or any collective-using code) between steps, redone after a fault.

A section is a function the job runs at step boundaries: after every ``every``-th committed step,
before the next step begins. It is registered, not called inline, because a replacement must take
part in the redone section with the survivors, and a replacement enters the script at
``job.steps()``, never at a line in the middle of the loop body. So the loop itself runs the due
sections at each boundary, on every rank alike: a fault inside one (a killed rank, an exception, an
aborted collective) is recovered like a fault in a step that changed nothing (every survivor's
replica is valid), and the section starts over on every rank. No rank completes a section before
every rank has done all of its work (``close_section`` in driver.py): one failing after the
section's last collective would otherwise redo it alone while its peers went on into the next
step. Once a rank has passed that barrier the section is complete, and a fault after it (what an
integration shows as the section closes, a rank lost as its peer passes the barrier) does not
redo it. The ranks agree on that in the recovery: an abort landing as the barrier completes
can leave a live rank failing it while its peer passed, so each rank reports the sections it
passed at its step, the plan says done where any did (coordinator/rules/sections.py), and a
rank whose barrier failed ends the section as if it had passed. What it recorded with
``job.record()`` is emitted once, when it completes, as a ``section`` event.

Which sections completed at the current boundary travels with the loop state
(``LoopControl.sections_done``), so a fault in the next step does not run an evaluation again,
and a replacement that joins during a section runs it with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from checkpointless.errors import ConfigError

__all__ = ["HeldLines", "Section", "due_sections"]


class HeldLines(Protocol):
    """What a section holds to show as it closes (its log lines), kept for a replacement
    (recovery/held_lines.py)."""

    def encode(self) -> bytes | None:
        """What ``closed`` is yet to show, as bytes; None when nothing is held (or it cannot be
        kept)."""

    def restore(self, data: bytes) -> None:
        """Hold ``data`` (a lost predecessor's ``encode()``), for ``closed`` to show."""


@dataclass(frozen=True)
class Section:
    """A registered section: ``fn()`` runs after every ``every``-th committed step."""

    name: str
    fn: Callable[[], Any]
    every: int
    at_start: bool = False  # also before step 0 (a baseline evaluation)
    # asked once at each boundary the period allows: the section runs there only if this is
    # true. For an integration whose work at a boundary is known only then (Trainer's evaluate
    # and save flags), so that a boundary with nothing to do costs no generator record and no
    # event. Ranks must answer alike wherever the body would use a collective
    when: Callable[[], bool] | None = None
    # run on every rank once the section has closed on every rank together (the step loop's
    # closing barrier, driver.close_section): what an integration kept to redo the section from
    # its start (the Trainer's SectionUndo) can go then, and not before, for until every rank is
    # past that barrier a fault anywhere redoes the section on every rank. From then on the
    # section is complete: if this raises, the fault is recovered without redoing the section
    # and this is called again, so it must go on where it stopped (held lines shown once)
    closed: Callable[[], None] | None = None
    # what ``closed`` will show, kept as the section's work is done: a replacement of a rank
    # lost after the closing barrier and before ``closed`` showed it shows it (held_lines.py)
    held: HeldLines | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a section needs a name, e.g. job.section('eval', evaluate, every=100)")
        if self.every < 1:
            raise ConfigError(
                f"section {self.name!r}: every must be a positive number of steps (got {self.every})"
            )


def due_sections(sections: list[Section], committed: int, done: dict[str, int]) -> list[Section]:
    """The sections to run at the boundary after ``committed`` steps, in registration order:
    those whose period divides it and that have not completed at this boundary yet.

    A section whose ``when`` says no is entered in ``done`` as settled at this boundary, as if
    it had completed: ``done`` travels with the loop state, so the answer stands for a replay of
    the next step and for a replacement, which do not ask again (what the flags it read say by
    then may be the next step's)."""
    out = []
    for s in sections:
        if committed == 0 and not s.at_start:
            continue
        if committed % s.every != 0 or done.get(s.name) == committed:
            continue
        if s.when is not None and not s.when():
            done[s.name] = committed
            continue
        out.append(s)
    return out
