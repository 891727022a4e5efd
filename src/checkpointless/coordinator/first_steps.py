"""A formed generation's first step: the recovery that formed it is reported (its downtime,
``coordinator/downtime.py``) once every rank has committed a step in it.

A recovery is not over when the group has formed: the state moved, the step is run again, and
only the first commit everywhere says it worked. A round that formed is therefore held here until
then, and flushed (reported with no first step) when the job ends or a newer fault comes first,
so that every round that formed a generation is counted.
"""

from __future__ import annotations

from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.state import Round

__all__ = ["FirstSteps"]


class FirstSteps:
    """The round that formed the current generation, until every slot has committed a step."""

    def __init__(self, ledger: FaultLedger, nproc: int) -> None:
        self.ledger = ledger
        self.nproc = nproc
        self.round: Round | None = None  # a formed round whose first step is not done everywhere
        self.commits: dict[int, float] = {}  # slot -> when it committed its first step
        self.batches: dict[int, float] = {}  # slot -> its first batch's seconds, as it reported

    def wait_for(self, r: Round) -> None:
        """``r`` formed its generation: reported once every slot's first step in it commits."""
        self.round = r
        self.commits = {}
        self.batches = {}

    def committed(self, slots: list[int], now: float, first_batch_s: float | None) -> None:
        """A first commit in the formed generation, of a rank and of the slots it holds."""
        pend = self.round
        if pend is None:
            return
        for slot in slots:
            self.commits[slot] = now
            if first_batch_s is not None:
                self.batches[slot] = first_batch_s
        if len(self.commits) < self.nproc:
            return
        self.round = None
        self.ledger.report_recovery(pend, max(self.commits.values()), self.batches)

    def flush(self, why: str) -> None:
        """Report a recovery whose first step never completed everywhere: every round that formed
        a generation is counted and reported, even when the job ended (or another fault came)
        before its first step did."""
        pend, self.round = self.round, None
        if pend is not None:
            self.ledger.report_recovery(pend, None, self.batches, why)
