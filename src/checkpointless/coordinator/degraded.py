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
from checkpointless.coordinator.rules.mesh_width import mesh_leaving, mesh_not_shrinkable
from checkpointless.coordinator.rules.width import (
    NoSparePolicy,
    WidthAction,
    WidthDecision,
    WidthSituation,
    width_decision,
)
from checkpointless.coordinator.spares import SparePool
from checkpointless.coordinator.state import Round
from checkpointless.settings import JobSettings

__all__ = ["DegradedMode"]


# Why a rank lost while the job's first generation forms waits for a spare instead: a held slot
# is formed beside its holder's own groups by a recovery, not by the first generation, and the
# lost rank has no generator record yet for a holder to go on from (its per-rank seeds ran in a
# process that is gone). Found when a host was taken for lost at start-up on a loaded machine:
# the holders' first generation never formed and the job failed after 5 recoveries.
BEFORE_FIRST_GENERATION = (
    "the rank(s) were lost before the job's first generation formed, when no survivor can hold "
    "them yet; start the job again, or keep a spare (--spares, --spare-nodes)"
)


class DegradedMode:
    def __init__(
        self, cfg: JobSettings, members: Members, outbox: Outbox, spares: SparePool, holders: SlotHolders
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.outbox = outbox
        self.spares = spares
        self.holders = holders
        # the job's (replicate, shard) mesh once a member reported one (None: data parallel);
        # kept across rounds, since a round may decide before the survivors have reported
        self.mesh: tuple[int, int] | None = None

    def leaving(self, lost: list[int]) -> list[int]:
        """The live ranks that leave with the lost slots: on a mesh, the rest of their replica
        groups (rules/mesh_width.py); nobody else in data parallelism."""
        if self.mesh is None:
            return []
        return mesh_leaving(lost, self.mesh[1], self.holders.layout(self.cfg.nproc, lost))

    def decide(self, r: Round, ranks: list[int], ready: int, starting: int, now: float) -> WidthDecision:
        """The rule's answer for a round with ``ranks`` to fill, ``ready`` spares matched to them
        and ``starting`` on their way."""
        cfg = self.cfg
        waited = now - (r.waiting_since if r.waiting_since is not None else now)
        gone = [*ranks, *self.leaving(ranks)]
        not_shrinkable = mesh_not_shrinkable(self.mesh, ranks) if self.mesh is not None else ""
        if r.initial:
            not_shrinkable = not_shrinkable or BEFORE_FIRST_GENERATION
        d = width_decision(
            WidthSituation(
                width=cfg.nproc,
                survivors=len(self.holders.layout(cfg.nproc, gone)),
                needed=len(ranks),
                ready=ready,
                starting=starting,
                waited=waited,
                wait_limit=cfg.spare_wait,
                policy=NoSparePolicy(cfg.when_no_spare),
                min_replicas=cfg.min_replicas,
                not_shrinkable=not_shrinkable,
            )
        )
        if d.action == WidthAction.SHRINK and self.mesh is None:
            # Whether the job has a mesh is learnt from the survivors' reports (the first state
            # sync happens before the script makes one), and a mesh drops whole replica groups:
            # shrinking before they are in held a mesh's lost slot as data parallelism's (seen
            # under load: the degraded generation never formed). Reports come within moments.
            waiting = [k for k in self.holders.layout(cfg.nproc, ranks) if k not in r.reports]
            if waiting:
                return WidthDecision(
                    WidthAction.WAIT, d.spawn, f"waiting for the reports of rank(s) {waiting} to shrink"
                )
        return d

    def shrink(self, r: Round, lost: list[int], now: float) -> None:
        """No spare for the ``lost`` slots: survivors hold them from this round on, and the
        spares started for them grow the job back once ready (``Rounds.grow``). On a mesh the
        rest of each lost slot's replica group leaves too: its processes are stopped, its slots
        held by the ranks of the same shard coordinates, and a spare is started for each."""
        ms, nproc = self.members, self.cfg.nproc
        leaving = self.leaving(lost)
        for rank in leaving:
            self.outbox.kill(
                ms.ranks[rank], f"its replica group left the job with rank(s) {lost} (degraded HSDP)"
            )
        lost = sorted([*lost, *leaving])
        given = self.holders.shrink(nproc, lost, leaving=lost, shards=self.mesh[1] if self.mesh else None)
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
        if leaving:
            self.spares.refill(now)  # one spare per held slot: the group comes back whole

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
        slots = self.holders.to_grow(self.cfg.nproc, len(ready), self.mesh[1] if self.mesh else None)
        if not slots:
            return None
        step = max((m.step for m in unique(ms.ranks.values()) if m.step is not None), default=None)
        self.outbox.log(
            "info", f"spare(s) ready: growing back, slot(s) {slots} return to processes of their own"
        )
        return slots, step
