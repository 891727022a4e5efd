"""Degraded mode (issue 39): what to do when no spare is ready for a lost replica slot, the
shrink that lets survivors hold it, and which held slots ready spares take back.

A component of :class:`~checkpointless.coordinator.rounds.Rounds`, given its collaborators (the
members, the outbox, the spare pool and the slot holders that the round machinery shares) and
never the rounds themselves: the decision is ``rules/width.py``'s, the bookkeeping of who holds
which slot ``holders.py``'s, and the grow round is opened by ``Rounds.grow``.
"""

from __future__ import annotations

from dataclasses import replace as with_fields

from checkpointless.coordinator.holders import SlotHolders, unique
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.width import (
    NoSparePolicy,
    WidthDecision,
    WidthSituation,
    width_decision,
)
from checkpointless.coordinator.spares import SparePool
from checkpointless.coordinator.state import Round
from checkpointless.settings import JobSettings

__all__ = ["DegradedMode", "not_shrinkable"]


class DegradedMode:
    def __init__(
        self, cfg: JobSettings, members: Members, outbox: Outbox, spares: SparePool, holders: SlotHolders
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.outbox = outbox
        self.spares = spares
        self.holders = holders

    def decide(self, r: Round, ranks: list[int], ready: int, starting: int, now: float) -> WidthDecision:
        """The rule's answer for a round with ``ranks`` to fill, ``ready`` spares matched to them
        and ``starting`` on their way."""
        cfg = self.cfg
        waited = now - (r.waiting_since if r.waiting_since is not None else now)
        return width_decision(
            WidthSituation(
                width=cfg.nproc,
                survivors=len(self.holders.layout(cfg.nproc, ranks)),
                needed=len(ranks),
                ready=ready,
                starting=starting,
                waited=waited,
                wait_limit=cfg.spare_wait,
                policy=NoSparePolicy(cfg.when_no_spare),
                min_replicas=cfg.min_replicas,
                not_shrinkable=not_shrinkable(r),
            )
        )

    def shrink(self, r: Round, lost: list[int]) -> None:
        """No spare for the ``lost`` slots: survivors hold them from this round on, and the
        spares started for them grow the job back once ready (``Rounds.grow``)."""
        ms, nproc = self.members, self.cfg.nproc
        given = self.holders.shrink(nproc, lost, leaving=lost)
        for slot, holder in sorted(given.items()):
            old = ms.ranks.get(slot)
            if old is not None and old is not ms.ranks[holder]:
                self.outbox.kill(old, old.killed_for or "replaced")
            ms.ranks[slot] = ms.ranks[holder]
            r.replace.discard(slot)
            if holder in r.reports:  # its state is the holder's own
                r.reports[slot] = with_fields(r.reports[holder], rank=slot)
                r.report_times[slot] = r.report_times[holder]
        width = self.holders.width(nproc)
        self.outbox.emit("width", generation=r.target, width=width, slots=nproc, holders=self.holders.pairs())
        self.outbox.condition("spare_wait", False)
        self.outbox.condition(
            "degraded",
            True,
            f"running degraded: {width} of {nproc} replicas (slot, holder: {self.holders.pairs()}); "
            "the survivors train the lost slots' batches until spares take them back",
        )
        r.waiting_since = None

    def slots_to_grow(self, now: float) -> tuple[list[int], int | None] | None:
        """The held slots that ready spares take back now, and the step the job is at; None
        when no spare is ready, nothing is held or the job is ending."""
        ms = self.members
        ready = [
            m
            for m in ms.idle_spares()
            if m.ready and m.connected and m.killed_for is None and self.spares.promotable(m, now)
        ]
        if not ready or any(m.done for m in ms.ranks.values()):
            return None
        slots = self.holders.to_grow(self.cfg.nproc, len(ready))
        if not slots:
            return None
        step = max((m.step for m in unique(ms.ranks.values()) if m.step is not None), default=None)
        self.outbox.log(
            "info", f"spare(s) ready: growing back, slot(s) {slots} return to processes of their own"
        )
        return slots, step


def not_shrinkable(r: Round) -> str:
    """Why this round's job cannot go on with fewer replicas ("" when it can): degraded mode
    drops data-parallel replicas of a plain data-parallel job; a sharded mesh would have to drop
    a whole replica group, which is not built."""
    if any(rep.mesh is not None for rep in r.reports.values()):
        return "a sharded device mesh (FSDP/HSDP) cannot yet drop a replica group"
    return ""
