"""The host quarantine: each host's health as its agent reports it, and the hosts whose ranks keep
faulting. It owns one :class:`~checkpointless.coordinator.rules.health.HealthRecord` per host;
the decisions are the pure functions of ``rules/health.py``. The spare pool asks it which hosts
may take a rank (:meth:`HostQuarantine.promotable`) or a new spare (:meth:`quarantined`).

Only hosts with an agent of their own are gated: the coordinator's own host (the embedded agent
of ``checkpointless run``, or of a coordinator that took over) runs no checks and is promotable
unless its ranks' faults quarantined it.

What it says: a ``host_health`` event when a host's first report comes and whenever its verdict
or its failing checks change (not every report: a thousand hosts checking every minute must not
flood the event log), ``host_quarantined`` and ``host_readmitted`` events with the checks' output,
and a warning line for each quarantine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.budget import FaultRecord
from checkpointless.coordinator.rules.health import (
    Change,
    HealthRecord,
    after_fault,
    after_report,
    blocked_because,
    fresh_for,
)
from checkpointless.coordinator.state import Member
from checkpointless.protocol import HealthReport
from checkpointless.settings import JobSettings

__all__ = ["HostQuarantine"]

READMIT_AFTER = 1  # passing reports in a row that re-admit a host (its checks are the evidence)


class HostQuarantine:
    def __init__(self, cfg: JobSettings, members: Members, outbox: Outbox) -> None:
        self.cfg = cfg
        self.members = members
        self.outbox = outbox
        self.records: dict[int, HealthRecord] = {}
        self.expected: set[int] = set()  # hosts whose agents said they check their host
        self.max_age = fresh_for(cfg.health_interval, cfg.health_timeout)
        self._faults_seen = 0  # how many of the fault ledger's records were counted already

    # -- reports -------------------------------------------------------------------------------
    def on_report(self, host: int, msg: HealthReport, now: float) -> bool:
        """An agent's report; True when it quarantined or re-admitted its host (the spare pool
        then belongs elsewhere, or may come back)."""
        h = self.members.hosts.get(host)
        if h is None or h.lost:
            return False
        rec = self.records.get(host, HealthRecord())
        failing = [f"{n}: {d}" for n, p, d in zip(msg.names, msg.passed, msg.details, strict=False) if not p]
        ok = msg.ok and not failing
        detail = "; ".join(failing) or ("" if ok else "the agent reported a failure")
        new, change = after_report(
            rec, ok, detail, now - max(0.0, msg.age), step=self._step(), window=self.cfg.fault_window,
            readmit_after=READMIT_AFTER,
        )  # fmt: skip
        self.records[host] = new
        if rec.ok is None or rec.ok != new.ok or (not ok and detail != rec.detail):
            checks = [
                {"name": n, "ok": p, "detail": d, "seconds": s}
                for n, p, d, s in zip(msg.names, msg.passed, msg.details, msg.seconds, strict=False)
            ]
            self.outbox.emit("host_health", host=host, address=h.address, ok=ok, detail=detail, checks=checks)
        self._announce(host, change)
        return change is not None

    def note_faults(self, history: Sequence[FaultRecord], ranks: Mapping[int, Member]) -> None:
        """Count the ledger's new faults against the hosts their ranks ran on. Called before any
        rank is handed to a spare (the coordinator's tick, before its round moves on), so
        ``ranks`` still names the process that faulted, and with it its host."""
        if len(history) == self._faults_seen:
            return  # every tick asks: nothing new is the common case
        new, self._faults_seen = history[self._faults_seen :], len(history)
        if len(self.members.hosts) < 2:
            return  # the only host: quarantining it would only stop the job
        live = self.members.live_hosts()
        for f in new:
            m = ranks.get(f.rank)
            if m is None or m.host not in live:
                continue  # a lost host is out of the job already
            rec = self.records.get(m.host, HealthRecord())
            self.records[m.host], change = after_fault(
                rec, f.step, f.kind, window=self.cfg.fault_window, limit=self.cfg.host_fault_limit
            )
            self._announce(m.host, change)

    # -- questions -----------------------------------------------------------------------------
    def quarantined(self, host: int) -> bool:
        rec = self.records.get(host)
        return rec is not None and bool(rec.quarantine)

    def promotable(self, host: int, now: float) -> bool:
        """Whether a spare on ``host`` may take a rank now."""
        return self.blocked_because(host, now) == ""

    def expect(self, host: int) -> None:
        """``host``'s agent said in its hello that it checks its host: until its first report
        comes, its spares take no rank."""
        self.expected.add(host)

    def blocked_because(self, host: int, now: float) -> str:
        """Why a spare on ``host`` may not take a rank now ("" when it may)."""
        h = self.members.hosts.get(host)
        rec = self.records.get(host)
        reported = rec is not None and rec.ok is not None
        if (h is not None and not h.remote) or (host not in self.expected and not reported):
            # The coordinator's own host runs no checks, nor does an agent that did not say it
            # would (one that a successor inherited reports again as it rejoins): only its
            # ranks' faults can hold it back.
            return f"quarantined ({rec.quarantine}): {rec.why}" if rec is not None and rec.quarantine else ""
        return blocked_because(rec, now, self.max_age)

    def note(self) -> str:
        """The live hosts in quarantine, with why, for a failure's reason ("" when none)."""
        live = self.members.live_hosts()
        parts = [
            f"host {self.members.hosts[host].address} (agent {host}) is quarantined ({rec.quarantine}): {rec.why}"
            for host, rec in sorted(self.records.items())
            if rec.quarantine and host in live
        ]
        return "; ".join(parts)

    # -- plumbing ------------------------------------------------------------------------------
    def _step(self) -> int | None:
        steps = [m.step for m in self.members.ranks.values() if m.step is not None]
        return min(steps) if steps else None

    def _announce(self, host: int, change: Change | None) -> None:
        if change is None:
            return
        h = self.members.hosts[host]
        if change.kind == "quarantined":
            self.outbox.emit(
                "host_quarantined", host=host, address=h.address, reason=change.reason, detail=change.detail
            )
            self.outbox.log(
                "warning",
                f"host {h.address} (agent {host}) quarantined: {change.detail}; it takes no spare and no "
                "rank until it is re-admitted",
            )
        else:
            self.outbox.emit(
                "host_readmitted", host=host, address=h.address, reason=change.reason, detail=change.detail
            )
            self.outbox.log("info", f"host {h.address} (agent {host}) re-admitted after {change.detail}")
