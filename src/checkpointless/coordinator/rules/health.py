"""Health-gated admission as pure functions: a host's health record in, the next record and what
changed out. No I/O, no clock: times are the coordinator's monotonic ``now``.

A host is *quarantined* (never promoted, never given a new spare or rank) for one of two reasons:

* ``health``: its agent's checks failed (agent/health.py). Its agent keeps checking every
  ``--health-interval``; ``readmit_after`` passing reports in a row re-admit it.
* ``faults``: its ranks faulted at ``limit`` different steps within ``window`` steps
  (``--host-fault-limit``, ``--fault-window``), the fault budget's idea (rules/budget.py) applied
  to a host instead of a rank. Faults at one step count once (a lost host's ranks all fail at
  the same step: one incident), and a symptom (a collective that failed because a peer died)
  never counts. It is re-admitted once the job has moved ``window`` steps past its last fault
  and a check has passed since.

A spare host's spares are *promotable* only while it is not quarantined and its newest report
passed and is fresh: younger than :func:`fresh_for` (two intervals and a check's timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "SYMPTOMS",
    "Change",
    "HealthRecord",
    "after_fault",
    "after_report",
    "blocked_because",
    "fresh_for",
    "promotable",
]

# a fault that only follows another (rules/budget.py's symptoms): never a host's own fault
SYMPTOMS = frozenset({"comm", "stall", "recovery"})


@dataclass(frozen=True)
class HealthRecord:
    """What the coordinator knows of one host's health."""

    ok: bool | None = None  # the newest report's verdict; None: no report yet
    checked_at: float | None = None  # when that report's checks finished (coordinator clock)
    detail: str = ""  # the newest failing report's failing checks
    passes: int = 0  # passing reports in a row
    quarantine: str = ""  # "" (admitted), "health" or "faults"
    why: str = ""  # what put it in quarantine: the checks' output, or the faults
    fault_steps: tuple[int, ...] = ()  # distinct steps of its recent own faults, oldest first


@dataclass(frozen=True)
class Change:
    """A host entered (``quarantined``) or left (``readmitted``) quarantine."""

    kind: str  # quarantined | readmitted
    reason: str  # health | faults
    detail: str


def fresh_for(interval: float, timeout: float) -> float:
    """How old a passing report may be for its host to be promoted (0: any age, when the agents
    check only as they join)."""
    return 0.0 if interval <= 0 else 2 * interval + timeout


def after_report(
    rec: HealthRecord,
    ok: bool,
    detail: str,
    at: float,
    *,
    step: int | None = None,
    window: int = 0,
    readmit_after: int = 1,
) -> tuple[HealthRecord, Change | None]:
    """A report (``ok``, the failing checks' ``detail``, its checks finished at ``at``) about a
    host whose record is ``rec``; ``step`` is the job's step now (for a fault quarantine)."""
    if not ok:
        new = replace(rec, ok=False, checked_at=at, detail=detail, passes=0)
        if rec.quarantine == "health":
            return replace(new, why=detail), None
        # a host already quarantined for faults now fails its checks: its checks decide from here
        return replace(new, quarantine="health", why=detail), Change("quarantined", "health", detail)
    new = replace(rec, ok=True, checked_at=at, passes=rec.passes + 1)
    if not rec.quarantine or new.passes < readmit_after:
        return new, None
    if rec.quarantine == "faults":
        recent = rec.fault_steps and (step is None or step - rec.fault_steps[-1] <= window)
        if recent:
            return new, None
    what = f"{new.passes} passing check(s) in a row"
    return replace(new, quarantine="", why="", fault_steps=()), Change("readmitted", rec.quarantine, what)


def after_fault(
    rec: HealthRecord, step: int | None, kind: str, *, window: int, limit: int
) -> tuple[HealthRecord, Change | None]:
    """A fault of one of the host's ranks at ``step``: counted, and a quarantine once ``limit``
    distinct steps fall within ``window`` steps (``limit`` 0: never)."""
    if limit <= 0 or step is None or kind in SYMPTOMS:
        return rec, None
    steps = tuple(sorted({s for s in rec.fault_steps if step - window <= s <= step} | {step}))
    new = replace(rec, fault_steps=steps)
    if rec.quarantine or len(steps) < limit:
        return new, None
    why = (
        f"its ranks faulted at steps {list(steps)}: {len(steps)} within {window} steps "
        f"(--host-fault-limit {limit}, --fault-window {window})"
    )
    return replace(new, quarantine="faults", why=why, passes=0), Change("quarantined", "faults", why)


def promotable(rec: HealthRecord | None, now: float, max_age: float) -> bool:
    """Whether a spare on this host may take a rank now."""
    return blocked_because(rec, now, max_age) == ""


def blocked_because(rec: HealthRecord | None, now: float, max_age: float) -> str:
    """Why a spare on this host may not take a rank now ("" when it may)."""
    if rec is None or rec.ok is None:
        return "no health report yet"
    if rec.quarantine:
        return f"quarantined ({rec.quarantine}): {rec.why}"
    if not rec.ok:
        return f"its checks failed: {rec.detail}"
    if max_age > 0 and rec.checked_at is not None and now - rec.checked_at > max_age:
        return f"its newest passing check is {now - rec.checked_at:.0f} s old (more than {max_age:.0f} s)"
    return ""
