"""What a rank says in a recovery about the sections it passed, and what it leaves for its
replacement to say: the worker's half of coordinator/rules/sections.py.

A section is complete once any rank has passed its closing barrier (every rank's work in it is
done by then). In a recovery each rank reports the sections it passed at the boundary it stopped
at (``LoopControl.closed_at``), and the plan says done where any did. A rank lost just after it
passed, while its live peer's barrier failed as it completed, would leave nobody to say so, and
the peer and the replacement would redo the section: what the lost rank did after the barrier
(its ``section`` event, the lines it showed) would come twice. So each rank also marks, on its
host beside its generator records (``<job shm>/rng/rank<k>.passed``), the last boundary and
section it passed, and its replacement reports that mark as it joins. The mark is also written
as the rank enters the barrier, not passed: a replacement that finds only that cannot say whether
its predecessor passed, and reports it (``sections_entered``), so the redo is said, not silent.
The mark also rides in the rank's generator record to its keeper one host over
(section_closing.py), and the keeper
reports the sections its owners passed beside its own: after a host loss the section is still
taken as complete (unless the keeper reported before the owner's mark reached it: then it is
redone, the ranks still agree, and the keeper reports the owner as undecided).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checkpointless.events import get_logger
from checkpointless.recovery.member import Member
from checkpointless.recovery.section_closing import own_left, owners_closings

__all__ = ["PassMark", "pass_mark", "sections_report"]

log = get_logger()


class PassMark:
    """Rank ``rank``'s mark of the last section closing barrier it entered, and whether it passed
    it, in ``directory`` (None: not under the launcher, nothing kept)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.path = None if directory is None else directory / f"rank{rank}.passed"

    def mark(self, step: int, section: str, passed: bool = True) -> None:
        """This rank entered (``passed`` False) or passed the closing barrier of ``section`` at
        the boundary after ``step`` steps (a few tens of microseconds on shared memory, twice
        per section run)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".passed.tmp")
        tmp.write_text(json.dumps({"step": step, "section": section, "passed": passed}))
        os.replace(tmp, self.path)  # whole or not at all: a SIGKILL leaves the older mark

    def read(self) -> tuple[int, str, bool] | None:
        """(boundary, section, passed) of the last mark, by this process or its predecessor;
        None if there is none or it cannot be read."""
        if self.path is None:
            return None
        try:
            head = json.loads(self.path.read_text())
            step, section, passed = head["step"], head["section"], head.get("passed", True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if type(step) is not int or not isinstance(section, str) or type(passed) is not bool:
            return None
        return step, section, passed


def pass_mark(member: Member) -> PassMark:
    keeper = member.replicas.rank_rng  # beside this rank's generator records
    return PassMark(keeper.directory, keeper.rank)


def sections_report(member: Member, committed: int) -> dict[str, Any]:
    """The ``Stopped`` fields about sections: those this rank passed at the boundary after
    ``committed`` steps; for a replacement that has run nothing yet, those its predecessor
    marked, at the boundary it marked them.

    ``sections_entered`` (section -> ranks) names the ranks lost in, or just past, a closing
    barrier nobody here can say they passed: a predecessor whose mark says it entered and not
    that it passed (a SIGKILL between the barrier's completion and the mark), or an owner whose
    keeper's wait ran out (section_closing.py). If no rank passed, the section is redone, and
    the launcher says that what such a rank did past the barrier may then come twice."""
    if not (member.is_replacement and committed < 0):
        own = member.loop.closed_at(committed)
        # ... and, as the keeper of other ranks' records one host over, those they passed there:
        # an owner lost with its host leaves nobody else to say so (section_closing.py)
        passed, undecided = owners_closings(member, committed, own)
        theirs = [name for name in passed if name not in own]
        if theirs:
            log.info(
                "a rank whose records this rank keeps passed section(s) %s at step %d", theirs, committed
            )
        entered = {"sections_entered": undecided} if undecided else {}
        left = own_left(member, committed)  # its own barrier failed: a lost peer may have passed
        return {
            "sections_closed": sorted([*own, *theirs]),
            **entered,
            **({"sections_left": left} if left else {}),
        }
    mark = pass_mark(member).read()
    if mark is None:
        return {}
    step, section, passed_it = mark
    if passed_it:
        return {"sections_closed": [section], "sections_step": step}
    return {"sections_entered": {section: [member.rank]}, "sections_step": step}
