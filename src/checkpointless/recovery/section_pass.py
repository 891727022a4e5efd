"""What a rank says in a recovery about the sections it passed, and what it leaves for its
replacement to say: the worker's half of coordinator/rules/sections.py.

A section is complete once any rank has passed its closing barrier (every rank's work in it is
done by then). In a recovery each rank reports the sections it passed at the boundary it stopped
at (``LoopControl.closed_at``), and the plan says done where any did. A rank lost just after it
passed, while its live peer's barrier failed as it completed, would leave nobody to say so, and
the peer and the replacement would redo the section: what the lost rank did after the barrier
(its ``section`` event, the lines it showed) would come twice. So each rank also marks, on its
host beside its generator records (``<job shm>/rng/rank<k>.passed``), the last boundary and
section it passed, and its replacement reports that mark as it joins. On the rank's host only:
after a host loss nothing is reported, and the section is redone (the ranks still agree).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checkpointless.recovery.member import Member

__all__ = ["PassMark", "pass_mark", "sections_report"]


class PassMark:
    """Rank ``rank``'s mark of the last section closing barrier it passed, in ``directory``
    (None: not under the launcher, nothing kept)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.path = None if directory is None else directory / f"rank{rank}.passed"

    def mark(self, step: int, section: str) -> None:
        """This rank passed the closing barrier of ``section`` at the boundary after ``step``
        steps (a few tens of microseconds on shared memory, once per section run)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".passed.tmp")
        tmp.write_text(json.dumps({"step": step, "section": section}))
        os.replace(tmp, self.path)  # whole or not at all: a SIGKILL leaves the older mark

    def read(self) -> tuple[int, str] | None:
        """(boundary, section) of the last mark, by this process or its predecessor; None if
        there is none or it cannot be read."""
        if self.path is None:
            return None
        try:
            head = json.loads(self.path.read_text())
            step, section = head["step"], head["section"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if type(step) is not int or not isinstance(section, str):
            return None
        return step, section


def pass_mark(member: Member) -> PassMark:
    keeper = member.replicas.rank_rng  # beside this rank's generator records
    return PassMark(keeper.directory, keeper.rank)


def sections_report(member: Member, committed: int) -> dict[str, Any]:
    """The ``Stopped`` fields about sections: those this rank passed at the boundary after
    ``committed`` steps; for a replacement that has run nothing yet, those its predecessor
    marked, at the boundary it marked them."""
    if not (member.is_replacement and committed < 0):
        return {"sections_closed": member.loop.closed_at(committed)}
    passed = pass_mark(member).read()
    if passed is None:
        return {}
    return {"sections_closed": [passed[1]], "sections_step": passed[0]}
