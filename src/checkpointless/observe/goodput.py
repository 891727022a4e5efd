"""Goodput kept as the job runs: the ledger's arithmetic, O(1) per record and per query.

:func:`~checkpointless.observe.ledger.build_ledger` reads every event and every commit, which is
right for ``report`` and wrong for a Prometheus gauge: a scrape that rebuilds the ledger costs
O(steps), so the longer the job the longer each scrape holds the interpreter, until scrapes starve
the control loop (issue 36). :class:`GoodputMeter` charges the same segments, in the same order and
with the same clipping (a moving ``cursor`` keeps them disjoint), as the records arrive, and keeps
only what a later record can still need:

- the time of the latest commits (a recovery charges "replayed" work from the last commit before
  its fault fired), in a ring of :data:`RECENT_COMMITS`;
- the recent ``spare_assigned`` events (the "spare wait" of a recovery), in a ring too;
- the faults no recovery has closed yet (dropped as a recovery moves the cursor past them).

So its memory is bounded whatever the job's length. Where it can differ from the ledger:

- it is fed rank 0's commits only (``rank-0.jsonl``: rank 0 commits every step the job commits),
  while ``report`` reads every rank's. The last commit before a fault, and the last one before
  ``job_end``, can then be another rank's a fraction of a step later: the two differ by at most
  about one step time per recovery, plus one at the end;
- a fault that fired more than :data:`RECENT_COMMITS` commits after the commit it interrupted
  cannot happen (a fault stops commits), so the ring loses nothing in practice;
- records are taken in the order they come; the ledger sorts by time. The launcher writes its
  events in time order, and rank 0 its commits, so the two orders agree.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

__all__ = ["RECENT_COMMITS", "GoodputMeter"]

RECENT_COMMITS = 1024  # commit times kept for the "replayed" segment of the next recovery
_RECENT_ASSIGNED = 1024  # spare_assigned events kept for the "spare wait" of the next recovery
_OPEN_FAULTS = 4096  # fault times kept until a recovery closes them (only the first one counts)
_DOWNTIME_ORDER = ("abort", "spare_wait", "rebuild", "transfer", "coordination", "first_step")


def _t(e: Mapping[str, Any]) -> float:
    return float(e["time"])


class GoodputMeter:
    """The productive share of a job's wall time, fed launcher events and rank 0's commits.

    Thread-safe: the feeding thread and the scraping thread share one lock, held for O(1) work.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t0: float | None = None  # job_start
        self.end: float | None = None  # job_end
        self.startup_end: float | None = None  # generation 0 started (or the first commit)
        self.lost = 0.0  # seconds charged to a non-productive bucket so far (closed segments)
        self.cursor = 0.0  # nothing before this may be charged again: segments stay disjoint
        self.last_seen = 0.0  # the latest record's time (the end of a job whose launcher is gone)
        self.commits = 0
        self.recoveries = 0
        self._recent: deque[float] = deque(maxlen=RECENT_COMMITS)
        self._assigned: deque[tuple[int, float, int]] = deque(maxlen=_RECENT_ASSIGNED)
        self._open: deque[float] = deque()

    # -- feeding ---------------------------------------------------------------------------------
    def commit(self, t: float) -> None:
        """Rank 0 committed a step at wall time ``t``."""
        with self._lock:
            self.commits += 1
            self.last_seen = max(self.last_seen, t)
            if self._recent and t < self._recent[-1]:
                return  # out of order: cannot precede a later commit in the ring (see module doc)
            self._recent.append(t)
            if self.t0 is not None and self.startup_end is None and t >= self.t0:
                self._end_startup(t)  # the ledger's start-up ends at the first commit without "started"

    def event(self, e: Mapping[str, Any]) -> None:
        """One launcher event (every kind may come; only the ledger's few count)."""
        kind = e.get("event")
        try:
            t = _t(e)
        except (KeyError, TypeError, ValueError):
            return
        with self._lock:
            self.last_seen = max(self.last_seen, t)
            if kind == "job_start":
                if self.t0 is None:
                    self.t0 = self.cursor = t
            elif self.t0 is None or self.end is not None:
                return  # before the job's start, or after its end: the ledger ignores it too
            elif kind == "started":
                if self.startup_end is None:
                    self._end_startup(t)
            elif kind == "spare_assigned":
                self._assigned.append((int(e.get("rank", -1)), t, int(e.get("generation", 0))))
            elif kind == "fault":
                started = self.startup_end is not None and t > self.startup_end
                if started and t >= self.cursor and len(self._open) < _OPEN_FAULTS:
                    self._open.append(t)
            elif kind == "recovery":
                self._recovery(e)
            elif kind == "job_end":
                self._finish(t)

    # -- the ledger's arithmetic -----------------------------------------------------------------
    def _charge(self, start: float, stop: float) -> None:
        start = max(start, self.cursor)
        if stop > start:
            self.lost += stop - start
            self.cursor = stop

    def _end_startup(self, t: float) -> None:
        assert self.t0 is not None
        self.startup_end = t
        self._charge(self.t0, t)

    def _spare_wait(self, rec: Mapping[str, Any], collect: float) -> float:
        waits = []
        for f in rec.get("faults") or []:
            ft = float(f["time"])
            assigned = [
                at
                for rank, at, gen in self._assigned
                if rank == f.get("rank") and at >= ft and gen <= rec["generation"]
            ]
            if assigned:
                waits.append(min(assigned) - ft)
        return min(max(waits, default=0.0), collect)

    def _recovery(self, rec: Mapping[str, Any]) -> None:
        self.recoveries += 1
        if self.startup_end is None:
            self._end_startup(_t(rec))  # cannot happen in a launcher's log; keeps the cursor sane
        rfaults = rec.get("faults") or []
        downtime = float(rec["downtime_s"])
        detected = min((float(f["time"]) for f in rfaults), default=_t(rec) - downtime)
        detect = float(rec.get("detect_s", 0.0))
        collect = float(rec.get("collect_s", 0.0))
        spare = self._spare_wait(rec, collect)
        phases = {
            "abort": collect - spare,
            "spare_wait": spare,
            "rebuild": float(rec.get("rebuild_s", 0.0)),
            "transfer": float(rec.get("transfer_s", 0.0)),
            "first_step": float(rec.get("first_batch_s", 0.0)) + float(rec.get("first_step_s", 0.0)),
        }
        phases["coordination"] = max(0.0, downtime - sum(phases.values()))
        fired = detected - detect
        i = bisect.bisect_right(self._recent, fired)
        self._charge(self._recent[i - 1] if i else self.cursor, fired)  # replayed
        self._charge(fired, detected)  # detection
        at = detected
        for bucket in _DOWNTIME_ORDER:
            self._charge(at, at + phases[bucket])
            at += phases[bucket]
        while self._open and self._open[0] < self.cursor:
            self._open.popleft()  # this round's faults: closed

    def _finish(self, end: float) -> None:
        if self._open:  # the job ended on a fault no recovery closed
            self._charge(self._open[0], end)
        elif self._recent and self._recent[-1] >= self.cursor:
            self._charge(self._recent[-1], end)  # final barrier and exit
        self.end = end

    # -- reading ---------------------------------------------------------------------------------
    def goodput(self, now: float) -> float:
        """Productive seconds over wall seconds, to ``job_end`` or else to ``now``; O(1)."""
        with self._lock:
            if self.t0 is None:
                return 0.0
            if self.end is not None:
                end, lost = self.end, self.lost
            else:
                end = max(now, self.last_seen)
                if self.startup_end is None:
                    lost = end - self.t0  # still starting: nothing productive yet
                elif self._open:
                    lost = self.lost + max(0.0, end - max(self._open[0], self.cursor))
                else:
                    lost = self.lost
            wall = end - self.t0
            return max(0.0, wall - lost) / wall if wall > 0 else 0.0

    def held(self) -> int:
        """How many records the meter holds (a bound, whatever the job's length)."""
        with self._lock:
            return len(self._recent) + len(self._assigned) + len(self._open)
