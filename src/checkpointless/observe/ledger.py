"""The goodput ledger: where a job's wall time went, as a pure function of its event records.

Wall time runs from ``job_start`` to ``job_end`` (or to "now" for a job that is still running,
or to the last record written when the launcher was killed). It is cut into disjoint segments,
each charged to one bucket; productive time is whatever no other bucket claims, so the buckets
add up to the wall time by construction. Per recovery, the segments come from the ``recovery``
event's own phases, so the ledger's phases are the launcher's measurements, not re-estimates:

    last commit    fault fired     detected (fault event)                     every rank committed
        |--replayed--|--detection--|--abort--|--spare wait--|--rebuild--|--transfer--|--coord.--|--first step--|
                                   \\________________________ downtime_s ____________________________________/

The phases ran in that order on the slowest rank; drawing them end to end is exact for their
sum (``downtime_s``) and an approximation for where each one starts.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUCKETS", "BUCKET_LABELS", "FaultCost", "Ledger", "Segment", "build_ledger", "goodput_curve"]

BUCKET_LABELS: dict[str, str] = {
    "productive": "productive steps",
    "startup": "start-up (launch to generation 0)",
    "detection": "detection (fault to noticed)",
    "replayed": "replayed work (interrupted step)",
    "abort": "abort / stop",
    "spare_wait": "waiting for a spare",
    "rebuild": "communicator rebuild",
    "transfer": "state transfer",
    "coordination": "plan and messages",
    "first_step": "first step after recovery",
    "unrecovered": "fault not (yet) recovered",
    "shutdown": "final barrier and exit",
}
BUCKETS: tuple[str, ...] = tuple(BUCKET_LABELS)
_DOWNTIME_ORDER = ("abort", "spare_wait", "rebuild", "transfer", "coordination", "first_step")


@dataclass(frozen=True)
class Segment:
    """One stretch of wall time charged to ``bucket``; ``fault`` indexes ``Ledger.faults``."""

    start: float
    end: float
    bucket: str
    fault: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FaultCost:
    """One recovery round: what caused it and what each bucket cost (seconds)."""

    generation: int
    causes: str  # "killed on rank 1, exception on rank 2"
    detected_at: float  # wall time the launcher noticed the first fault of the round
    recovered: bool
    phases: dict[str, float]  # bucket -> seconds, as charged in the ledger
    event: dict[str, float]  # the recovery event's own phase fields, verbatim
    downtime_s: float
    state_bytes: float

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())


@dataclass(frozen=True)
class Ledger:
    start: float
    end: float
    finished: bool  # a job_end record exists
    status: str  # ok | failed | running | launcher gone
    nproc: int
    totals: dict[str, float]  # every bucket in BUCKETS; they sum to wall_s
    faults: list[FaultCost]
    segments: list[Segment]  # every non-productive segment, in time order
    steps_committed: int
    step_time_s: float | None  # median duration of a step, from consecutive commits
    first_step_s: float | None  # generation 0's first step, warm-up included
    state_bytes: float  # one replica's state, as sent in the largest transfer
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        return self.totals["productive"] / self.wall_s if self.wall_s > 0 else 0.0


def _of(events: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def _t(e: Mapping[str, Any]) -> float:
    return float(e["time"])


def _step_time(commits: Sequence[Mapping[str, Any]]) -> float | None:
    """Median gap between a rank's consecutive commits within one generation (no recovery in it)."""
    last: dict[int, Mapping[str, Any]] = {}
    gaps: list[float] = []
    for c in commits:
        rank = int(c.get("rank", -1))
        prev = last.get(rank)
        if (
            prev is not None
            and prev.get("generation") == c.get("generation")
            and int(c["step"]) == int(prev["step"]) + 1
            and not c.get("rolled_forward")
        ):
            gaps.append(_t(c) - _t(prev))
        last[rank] = c
    return statistics.median(gaps) if gaps else None


def _causes(faults: Sequence[Mapping[str, Any]]) -> str:
    # a failed collective on a survivor is a symptom; name the causes when they are known
    real = [f for f in faults if f.get("kind") != "comm"] or list(faults)
    return ", ".join(f"{f.get('kind')} on rank {f.get('rank')}" for f in real)


def _spare_wait(rec: Mapping[str, Any], events: Sequence[Mapping[str, Any]], collect: float) -> float:
    """From a replaced rank's fault to its spare's assignment: the longest such wait in the round."""
    waits = []
    for f in rec.get("faults", []):
        assigned = [
            _t(e)
            for e in _of(events, "spare_assigned")
            if e.get("rank") == f.get("rank")
            and _t(e) >= float(f["time"])
            and e.get("generation", 0) <= rec["generation"]
        ]
        if assigned:
            waits.append(min(assigned) - float(f["time"]))
    return min(max(waits, default=0.0), collect)


def build_ledger(
    events: Sequence[Mapping[str, Any]], commits: Sequence[Mapping[str, Any]], now: float | None = None
) -> Ledger:
    """The ledger of one job from its launcher ``events`` and its ranks' ``commits``.

    ``now`` is the end of a job without a ``job_end`` (a running one); without it, the last
    record written is taken as the end (a launcher that was killed writes nothing more).
    """
    starts = _of(events, "job_start")
    if not starts:
        raise ValueError("no job_start event: the launcher never started this job")
    t0 = _t(starts[0])
    nproc = int(starts[0].get("nproc", 0))
    ends = _of(events, "job_end")
    last_seen = max([_t(e) for e in events] + [_t(c) for c in commits])
    if ends:
        end, status = _t(ends[-1]), str(ends[-1].get("status", "failed"))
    elif now is not None:
        end, status = max(now, last_seen), "running"
    else:
        end, status = last_seen, "launcher gone"
    commits = sorted((c for c in commits if t0 <= _t(c) <= end), key=_t)
    commit_times = [_t(c) for c in commits]

    segs: list[Segment] = []
    cursor = t0  # nothing before this may be charged again: segments stay disjoint

    def charge(start: float, stop: float, bucket: str, fault: int | None = None) -> None:
        nonlocal cursor
        start, stop = max(start, cursor), min(stop, end)
        if stop > start:
            segs.append(Segment(start, stop, bucket, fault))
            cursor = stop

    started = _of(events, "started")
    startup_end = _t(started[0]) if started else (commit_times[0] if commit_times else end)
    charge(t0, startup_end, "startup")

    faults_out: list[FaultCost] = []
    recoveries = sorted(_of(events, "recovery"), key=_t)
    for rec in recoveries:
        rfaults = rec.get("faults") or []
        detected = min((float(f["time"]) for f in rfaults), default=_t(rec) - float(rec["downtime_s"]))
        detect = float(rec.get("detect_s", 0.0))
        collect = float(rec.get("collect_s", 0.0))
        spare = _spare_wait(rec, events, collect)
        phases = {
            "detection": detect,
            "abort": collect - spare,
            "spare_wait": spare,
            "rebuild": float(rec.get("rebuild_s", 0.0)),
            "transfer": float(rec.get("transfer_s", 0.0)),
            "first_step": float(rec.get("first_batch_s", 0.0)) + float(rec.get("first_step_s", 0.0)),
        }
        downtime = float(rec["downtime_s"])
        accounted = sum(v for k, v in phases.items() if k != "detection")
        phases["coordination"] = max(0.0, downtime - accounted)
        idx = len(faults_out)
        fired = detected - detect
        before = [t for t in commit_times if t <= fired]
        replay_from = before[-1] if before else cursor
        charge(replay_from, fired, "replayed", idx)
        charge(fired, detected, "detection", idx)
        at = detected
        for bucket in _DOWNTIME_ORDER:
            charge(at, at + phases[bucket], bucket, idx)
            at += phases[bucket]
        # what the ledger charged (clipped where a phase overlapped an earlier segment)
        charged = {
            b: sum(s.seconds for s in segs if s.fault == idx and s.bucket == b)
            for b in ("replayed", "detection", *_DOWNTIME_ORDER)
        }
        event_fields = {
            k: float(rec[k])
            for k in ("detect_s", "collect_s", "rebuild_s", "transfer_s", "first_batch_s", "first_step_s")
            if k in rec
        }
        faults_out.append(
            FaultCost(
                generation=int(rec["generation"]),
                causes=_causes(rfaults),
                detected_at=detected,
                recovered=True,
                phases=charged,
                event=event_fields,
                downtime_s=downtime,
                state_bytes=float(rec.get("state_bytes") or 0.0),
            )
        )

    # faults after the last recovery that no recovery closed: the job failed, or is recovering now
    open_faults = [f for f in _of(events, "fault") if _t(f) >= cursor and _t(f) > startup_end]
    if open_faults:
        idx = len(faults_out)
        first = min(_t(f) for f in open_faults)
        charge(first, end, "unrecovered", idx)
        faults_out.append(
            FaultCost(
                # absent or null (allowed by the records) counts as before generation 0
                generation=g + 1 if isinstance(g := open_faults[0].get("generation"), int) else 0,
                causes=_causes(open_faults),
                detected_at=first,
                recovered=False,
                phases={"unrecovered": max(0.0, end - max(first, startup_end))},
                event={},
                downtime_s=max(0.0, end - first),
                state_bytes=0.0,
            )
        )
    if ends and commit_times and commit_times[-1] >= cursor:
        charge(commit_times[-1], end, "shutdown")

    totals = {b: 0.0 for b in BUCKETS}
    for s in segs:
        totals[s.bucket] += s.seconds
    totals["productive"] = (end - t0) - sum(totals.values())
    steps_src = [c for c in commits if c.get("rank") == 0] or list(commits)
    first_commit = next((t for t in commit_times if t >= startup_end), None)
    return Ledger(
        start=t0,
        end=end,
        finished=bool(ends),
        status=status,
        nproc=nproc,
        totals=totals,
        faults=faults_out,
        segments=segs,
        steps_committed=len({int(c["step"]) for c in steps_src}),
        step_time_s=_step_time(commits),
        first_step_s=(first_commit - startup_end) if first_commit is not None and started else None,
        state_bytes=max((f.state_bytes for f in faults_out), default=0.0),
    )


def goodput_curve(ledger: Ledger, points: int = 200) -> list[tuple[float, float]]:
    """(seconds since start, productive share of the time so far), sampled evenly."""
    out: list[tuple[float, float]] = []
    wall = ledger.wall_s
    if wall <= 0:
        return out
    for i in range(1, points + 1):
        t = ledger.start + wall * i / points
        lost = sum(max(0.0, min(s.end, t) - s.start) for s in ledger.segments if s.start < t)
        out.append((t - ledger.start, max(0.0, (t - ledger.start - lost) / (t - ledger.start))))
    return out
