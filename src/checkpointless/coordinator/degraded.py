"""Degraded mode's rounds (issue 39): shrinking the job when no spare is ready, and growing it
back when one is.

Functions of :class:`~checkpointless.coordinator.rounds.Rounds` (its round machinery does the
rest: aborts, reports, the plan): the decision is ``rules/width.py``'s, the bookkeeping of who
holds which slot ``holders.py``'s.
"""

from __future__ import annotations

from dataclasses import replace as with_fields
from typing import TYPE_CHECKING

from checkpointless.coordinator.holders import unique
from checkpointless.coordinator.rules.width import (
    NoSparePolicy,
    WidthDecision,
    WidthSituation,
    width_decision,
)

if TYPE_CHECKING:
    from checkpointless.coordinator.rounds import Rounds
    from checkpointless.coordinator.state import Round

__all__ = ["decide_width", "grow_round", "shrink_round"]


def decide_width(
    rounds: Rounds, r: Round, ranks: list[int], ready: int, starting: int, now: float
) -> WidthDecision:
    """The rule's answer for a round with ``ranks`` to fill, ``ready`` spares matched to them
    and ``starting`` on their way."""
    cfg = rounds.cfg
    waited = now - (r.waiting_since if r.waiting_since is not None else now)
    return width_decision(
        WidthSituation(
            width=cfg.nproc,
            survivors=len(rounds.holders.layout(cfg.nproc, ranks)),
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


def not_shrinkable(r: Round) -> str:
    """Why this round's job cannot go on with fewer replicas ("" when it can): degraded mode
    drops data-parallel replicas of a plain data-parallel job; a sharded mesh would have to drop
    a whole replica group, which is not built."""
    if any(rep.mesh is not None for rep in r.reports.values()):
        return "a sharded device mesh (FSDP/HSDP) cannot yet drop a replica group"
    return ""


def shrink_round(rounds: Rounds, r: Round, lost: list[int]) -> None:
    """No spare for the ``lost`` slots: survivors hold them from this round on, and the
    spares started for them grow the job back once ready (``grow``)."""
    ms, nproc = rounds.members, rounds.cfg.nproc
    given = rounds.holders.shrink(nproc, lost, leaving=lost)
    for slot, holder in sorted(given.items()):
        old = ms.ranks.get(slot)
        if old is not None and old is not ms.ranks[holder]:
            rounds.outbox.kill(old, old.killed_for or "replaced")
        ms.ranks[slot] = ms.ranks[holder]
        r.replace.discard(slot)
        if holder in r.reports:  # its state is the holder's own
            r.reports[slot] = with_fields(r.reports[holder], rank=slot)
            r.report_times[slot] = r.report_times[holder]
    width = rounds.holders.width(nproc)
    rounds.outbox.emit("width", generation=r.target, width=width, slots=nproc, holders=rounds.holders.pairs())
    rounds.outbox.condition("spare_wait", False)
    rounds.outbox.condition(
        "degraded",
        True,
        f"running degraded: {width} of {nproc} replicas (slot, holder: {rounds.holders.pairs()}); "
        "the survivors train the lost slots' batches until spares take them back",
    )
    r.waiting_since = None


def grow_round(rounds: Rounds, now: float, wall: float) -> None:
    """Degraded, between rounds, with spares ready: a round in which they take held slots
    back (the job aborts its step, the spares receive state, the step is replayed)."""
    ms = rounds.members
    ready = [
        m
        for m in ms.idle_spares()
        if m.ready and m.connected and m.killed_for is None and rounds.spares.promotable(m, now)
    ]
    if not ready or any(m.done for m in ms.ranks.values()):
        return
    slots = rounds.holders.to_grow(rounds.cfg.nproc, len(ready))
    if not slots:
        return
    step = max((m.step for m in unique(ms.ranks.values()) if m.step is not None), default=None)
    rounds.outbox.log(
        "info", f"spare(s) ready: growing back, slot(s) {slots} return to processes of their own"
    )
    for slot in slots:
        holder = rounds.holders.holder(slot)
        detail = f"a spare takes slot {slot} back from rank {holder}"
        record = {
            "time": wall,
            "rank": slot,
            "kind": "grow",
            "detail": detail,
            "step": step,
            "detected": now,
        }
        rounds.outbox.emit("grow", rank=slot, holder=holder, generation=rounds.generation, step=step)
        r = rounds.round if rounds.round is not None else rounds.begin(record, now)
        if r.faults[-1] is not record:
            r.faults.append(record)
        r.replace.add(slot)
        r.reports.pop(slot, None)
