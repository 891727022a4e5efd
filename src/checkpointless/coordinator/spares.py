"""The hot-spare pool: where new spares start, keeping the pool full, moving it to a host that
joins, and the prefetch hints its spares on spare hosts get. The decisions themselves are the
pure functions of ``rules/placement.py`` and ``rules/prefetch.py``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from checkpointless.coordinator.health import HostQuarantine
from checkpointless.coordinator.holders import SlotHolders
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.placement import (
    HostView,
    spare_host,
    spare_share,
    spares_to_move,
    squeezed_to_retire,
)
from checkpointless.coordinator.rules.prefetch import slot_ranks
from checkpointless.coordinator.state import RETIRED, Member
from checkpointless.protocol import Prefetch
from checkpointless.settings import JobSettings as LaunchConfig

__all__ = ["SparePool"]


class SparePool:
    def __init__(
        self,
        cfg: LaunchConfig,
        members: Members,
        outbox: Outbox,
        health: HostQuarantine | None = None,
        holders: SlotHolders | None = None,
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.outbox = outbox
        self.health = health  # the quarantine: which hosts may take a rank or a new spare
        # degraded mode's held slots (holders.py): each wants a spare of its own to grow back
        self.holders = holders if holders is not None else SlotHolders()
        # spares started on a joined host in place of squeezed ones, not yet standing in for them
        self.moving: set[int] = set()
        self.hinted: dict[int, int] = {}  # spare worker id -> the step of its last Prefetch

    def spawn(self, now: float, host: int | None = None, strict: bool = False) -> Member | None:
        """Start a spare on ``host``; without one, on a spare host, else (unless ``strict``) as a
        single spare onto a host that holds ranks; None when no live host may take one."""
        if host is not None and self.quarantined(host):
            host = None  # a quarantined host takes no new spare: one elsewhere, if any may
        if host is None:
            host = self.host_for(strict)
            if host is None:
                return None
        return self.members.spawn("spare", now, host)

    # -- the health gate (coordinator/health.py) ----------------------------------------------
    def quarantined(self, host: int) -> bool:
        return self.health is not None and self.health.quarantined(host)

    def promotable(self, m: Member, now: float) -> bool:
        """Whether spare ``m`` may take a rank now: its host is not quarantined, and (a host with
        an agent of its own) its newest health report passed and is fresh."""
        return self.health is None or self.health.promotable(m.host, now)

    def host_for(self, strict: bool = False, views: list[HostView] | None = None) -> int | None:
        """The host a new spare starts on (``strict``: only a host without ranks), or None."""
        if views is None:
            views = self.host_views()
        single = self.cfg.nnodes == 1 and len(self.members.hosts) == 1
        share = 0 if strict else spare_share(self.cfg.spares, sum(1 for v in views if v.ranks))
        return spare_host(views, self.cfg.per_node, single_host=single, share=share)

    def host_views(self) -> list[HostView]:
        # one pass over the ranks and processes, not one per host: a many-host job spawns a spare
        # host's worth of spares at once, and hosts x ranks per spawn was quadratic in the job size
        ms = self.members
        ranks = Counter(m.host for m in ms.ranks.values())
        procs = Counter(m.host for m in ms.procs.values())
        views = [
            HostView(h.host, ranks[h.host], procs[h.host])
            for h in ms.hosts.values()
            if not h.lost and not self.quarantined(h.host)
        ]
        if self.cfg.nnodes > 1 or len(ms.hosts) > 1:
            self.outbox.condition(
                "no_spare_host",
                bool(views) and not any(v.ranks == 0 for v in views),
                "no spare host is left: a process that fails alone is replaced by a spare on its "
                "own host, but the loss of a whole host now waits for a host to join (--spare-wait)",
            )
        return views

    def refill(self, now: float) -> None:
        """Start spares until the pool has ``--spares``, then, when a host without ranks has room,
        start spares there in place of those squeezed beside ranks (rules/placement.py)."""
        # The host views (a walk over every rank and process) are built once and kept up to date
        # as spares are placed: a lost host's worth of spares, each placed over a fresh walk,
        # was a third of a fault round's coordinator time at 80k ranks.
        views = self.host_views()  # also when none is spawned: a host may have joined or been lost
        # a quarantined host's spares cannot take a rank: others make up the pool meanwhile (they
        # are kept, warm, for when it is re-admitted)
        idle = sum(1 for m in self.members.idle_spares() if not self.quarantined(m.host))
        # a held slot's spare is on top of the pool: the round that shrank the job could find no
        # host for it when the lost host's ranks had nowhere to go, and a host that joins later
        # (a repaired node, a second allocation) must start it, or the job never grows back
        wanted = self.cfg.spares + len(self.holders.held)
        while idle < wanted:
            host = self.host_for(views=views)
            if host is None:
                return
            views = self._spawn_at(host, now, views)
            idle += 1
        if not any(v.ranks == 0 and v.procs < self.cfg.per_node for v in views):
            return  # no host without ranks has room (one machine never has one)
        rank_hosts = {v.host for v in views if v.ranks}
        squeezed = sum(1 for m in self._idle() if m.host in rank_hosts and m.killed_for is None)
        for _ in range(spares_to_move(views, squeezed, idle, wanted, self.cfg.per_node)):
            host = self.host_for(strict=True, views=views)
            if host is None:
                return
            views = self._spawn_at(host, now, views, moving=True)

    def retire_squeezed(self) -> None:
        """Spares that are ready on hosts without ranks stand in for the spares squeezed beside
        ranks (rules/placement.py): stop those, so the pool sits where a lost host's ranks can go."""
        ms = self.members
        if len(ms.hosts) < 2:
            return
        rank_hosts = ms.rank_hosts()
        live = [m for m in self._idle() if m.killed_for is None and not self.quarantined(m.host)]
        squeezed = [(m.worker_id, m.host) for m in live if m.host in rank_hosts]
        # only spares started to move the pool stand in for squeezed ones: a spare host's own ready
        # spares (or one that refilled a lost spare there) were counted in the pool already
        arrived = {m.worker_id for m in live if m.ready and m.worker_id in self.moving}
        for wid in squeezed_to_retire(squeezed, len(live), self.cfg.spares, len(arrived)):
            self.outbox.kill(ms.procs[wid], RETIRED)
            self.outbox.emit("spare_retired", worker=wid, host=ms.procs[wid].host)
        self.moving -= arrived  # they stand in now

    def hint(self) -> None:
        """Tell each idle spare on a spare host the job's step and the ranks it may take, once
        per step, so that it fills its own host's batch cache for them (data/spare_cache.py).
        The caller hints only while no round is open."""
        ms = self.members
        if self.cfg.nnodes < 2 or not ms.ranks:
            return
        steps = [m.step for m in ms.ranks.values()]
        if any(s is None for s in steps):
            return
        step = min(s for s in steps if s is not None)
        self.hinted = {w: s for w, s in self.hinted.items() if w in ms.procs}  # forget the gone
        holding = ms.rank_hosts()
        by_host: dict[int, list[Member]] = {}
        for m in ms.procs.values():
            if m.role == "spare" and m.rank is None and m.ready and m.host not in holding:
                by_host.setdefault(m.host, []).append(m)
        for spares in by_host.values():
            for i, m in enumerate(sorted(spares, key=lambda m: m.worker_id)):
                ranks = slot_ranks(i, self.cfg.per_node, self.cfg.nnodes)
                if ranks and self.hinted.get(m.worker_id) != step:
                    self.hinted[m.worker_id] = step
                    self.outbox.send(m, Prefetch(step=step, ranks=ranks, world_size=self.cfg.nproc))

    def _spawn_at(self, host: int, now: float, views: list[HostView], moving: bool = False) -> list[HostView]:
        m = self.members.spawn("spare", now, host)
        if moving:
            self.moving.add(m.worker_id)
        return [dataclasses.replace(v, procs=v.procs + 1) if v.host == host else v for v in views]

    def _idle(self) -> list[Member]:
        return [m for m in self.members.idle_spares() if not m.exited]
