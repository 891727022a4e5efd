"""The hot-spare pool: where new spares start, keeping the pool full, and moving it to a host
that joins. Functions of the :class:`Coordinator` they act on; the decisions themselves are the
pure functions of ``placement.py``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING

from checkpointless.coordinator.rules.placement import (
    HostView,
    spare_host,
    spare_share,
    spares_to_move,
    squeezed_to_retire,
)
from checkpointless.coordinator.state import RETIRED, Member

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator

__all__ = ["host_views", "idle_spares", "refill_spares", "retire_squeezed", "spare_host_for"]


def spare_host_for(c: Coordinator, strict: bool = False, views: list[HostView] | None = None) -> int | None:
    """The host a new spare starts on (``strict``: only a host without ranks), or None."""
    if views is None:
        views = host_views(c)
    single = c.cfg.nnodes == 1 and len(c.hosts) == 1
    share = 0 if strict else spare_share(c.cfg.spares, sum(1 for v in views if v.ranks))
    return spare_host(views, c.cfg.per_node, single_host=single, share=share)


def host_views(c: Coordinator) -> list[HostView]:
    # one pass over the ranks and processes, not one per host: a many-host job spawns a spare
    # host's worth of spares at once, and hosts x ranks per spawn was quadratic in the job size
    ranks = Counter(m.host for m in c.ranks.values())
    procs = Counter(m.host for m in c.procs.values())
    views = [HostView(h.host, ranks[h.host], procs[h.host]) for h in c.hosts.values() if not h.lost]
    if c.cfg.nnodes > 1 or len(c.hosts) > 1:
        c._condition(
            "no_spare_host",
            bool(views) and not any(v.ranks == 0 for v in views),
            "no spare host is left: a process that fails alone is replaced by a spare on its "
            "own host, but the loss of a whole host now waits for a host to join (--spare-wait)",
        )
    return views


def idle_spares(c: Coordinator) -> int:
    return sum(1 for m in c.procs.values() if m.role == "spare" and m.rank is None)


def refill_spares(c: Coordinator, now: float) -> None:
    """Start spares until the pool has ``--spares``, then, when a host without ranks has room,
    start spares there in place of those squeezed beside ranks (placement.py)."""
    # The host views (a walk over every rank and process) are built once and kept up to date
    # as spares are placed: a lost host's worth of spares, each placed over a fresh walk,
    # was a third of a fault round's coordinator time at 80k ranks.
    views = host_views(c)  # also when none is spawned: a host may have joined or been lost
    idle = idle_spares(c)
    while idle < c.cfg.spares:
        host = spare_host_for(c, views=views)
        if host is None:
            return
        views = _spawn_spare(c, host, now, views)
        idle += 1
    if not any(v.ranks == 0 and v.procs < c.cfg.per_node for v in views):
        return  # no host without ranks has room (one machine never has one)
    rank_hosts = {v.host for v in views if v.ranks}
    squeezed = sum(1 for m in _idle(c) if m.host in rank_hosts and m.killed_for is None)
    for _ in range(spares_to_move(views, squeezed, idle, c.cfg.spares, c.cfg.per_node)):
        host = spare_host_for(c, strict=True, views=views)
        if host is None:
            return
        views = _spawn_spare(c, host, now, views, moving=True)


def retire_squeezed(c: Coordinator) -> None:
    """Spares that are ready on hosts without ranks stand in for the spares squeezed beside
    ranks (placement.py): stop those, so the pool sits where a lost host's ranks can go."""
    if len(c.hosts) < 2:
        return
    rank_hosts = {m.host for m in c.ranks.values()}
    live = [m for m in _idle(c) if m.killed_for is None]
    squeezed = [(m.worker_id, m.host) for m in live if m.host in rank_hosts]
    # only spares started to move the pool stand in for squeezed ones: a spare host's own ready
    # spares (or one that refilled a lost spare there) were counted in the pool already
    arrived = {m.worker_id for m in live if m.ready and m.worker_id in c.moving_spares}
    for wid in squeezed_to_retire(squeezed, len(live), c.cfg.spares, len(arrived)):
        c._kill(c.procs[wid], RETIRED)
        c._emit("spare_retired", worker=wid, host=c.procs[wid].host)
    c.moving_spares -= arrived  # they stand in now


def _spawn_spare(
    c: Coordinator, host: int, now: float, views: list[HostView], moving: bool = False
) -> list[HostView]:
    m = c._spawn("spare", now, host=host)
    if moving and m is not None:
        c.moving_spares.add(m.worker_id)
    return [dataclasses.replace(v, procs=v.procs + 1) if v.host == host else v for v in views]


def _idle(c: Coordinator) -> list[Member]:
    return [m for m in c.procs.values() if m.role == "spare" and m.rank is None and not m.exited]
