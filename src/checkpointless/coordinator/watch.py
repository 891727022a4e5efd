"""What the coordinator watches between faults: hints to the spares on spare hosts about which
batches to prefetch, and hosts whose steps run slower than the others'. Functions of the
:class:`Coordinator` they act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointless.coordinator.faults import host_lost
from checkpointless.coordinator.rules.placement import pick_spares
from checkpointless.coordinator.rules.prefetch import slot_ranks
from checkpointless.coordinator.rules.stragglers import RankTiming
from checkpointless.coordinator.state import Kill, Member
from checkpointless.protocol import Prefetch

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator


__all__ = ["check_stragglers", "hint_spares"]


def hint_spares(c: Coordinator) -> None:
    """Tell each idle spare on a spare host the job's step and the ranks it may take, once
    per step, so that it fills its own host's batch cache for them (data/spare_cache.py)."""
    if c.round is not None or c.cfg.nnodes < 2 or not c.ranks:
        return
    steps = [m.step for m in c.ranks.values()]
    if any(s is None for s in steps):
        return
    step = min(s for s in steps if s is not None)
    c._hinted = {w: s for w, s in c._hinted.items() if w in c.procs}  # forget the gone
    holding = {m.host for m in c.ranks.values()}
    by_host: dict[int, list[Member]] = {}
    for m in c.procs.values():
        if m.role == "spare" and m.rank is None and m.ready and m.host not in holding:
            by_host.setdefault(m.host, []).append(m)
    for spares in by_host.values():
        for i, m in enumerate(sorted(spares, key=lambda m: m.worker_id)):
            ranks = slot_ranks(i, c.cfg.per_node, c.cfg.nnodes)
            if ranks and c._hinted.get(m.worker_id) != step:
                c._hinted[m.worker_id] = step
                c._send(m, Prefetch(step=step, ranks=ranks, world_size=c.cfg.nproc))


def check_stragglers(c: Coordinator, now: float, wall: float) -> None:
    """Report a host whose ranks are persistently slower than the others (the rule is
    coordinator/rules/stragglers.py); with --swap-stragglers, move its ranks to a spare host by the
    host-loss path: its workers are killed, the host is fenced, spares take the ranks.

    A straggler reported while no spare host is ready for all its ranks (the spares still
    starting, say) stays due for a move: it is tried again at each new step until it succeeds
    or the host is cleared, since the rule reports a host once, not at every slow step."""
    watch = c.stragglers
    if watch is None:
        return
    if c.round is not None or c.pending is not None:
        watch.reset()  # the members are changing: a window must not span a recovery
        return
    if any(m.done for m in c.ranks.values()):
        return  # training is over: moving a host now would only fail a finished job
    timings = [RankTiming(m.host, r, m.step, m.busy_time) for r, m in c.ranks.items()]
    sampled = watch.last_step
    for v, ranks in watch.observe(timings):
        h = c.hosts[v.host]
        if not v.reported:
            watch.due_moves.pop(v.host, None)
            c._emit("straggler_cleared", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio)
            c._log("info", f"host {h.address} (ranks {ranks}) is no longer a straggler")
            continue
        window = [round(x, 3) for x in v.window]
        c._emit("straggler", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio, window=window)
        c._log(
            "warning",
            f"straggler host {h.address} (agent {v.host}, ranks {ranks}): busy {v.ratio:.2f}x the "
            f"other hosts' over the last {len(window)} steps",
        )
        if c.cfg.swap_stragglers and _move(c, v.host, v.ratio, now, wall):
            return
    if watch.last_step != sampled:  # a new step: try the moves still due (spares may be ready now)
        for host, ratio in sorted(watch.due_moves.items()):
            if _move(c, host, ratio, now, wall):
                return


def _move(c: Coordinator, host: int, ratio: float, now: float, wall: float) -> bool:
    """Move a straggler host's ranks to a spare host, or leave the move due (logged once)."""
    assert c.stragglers is not None
    h = c.hosts[host]
    ranks = sorted(r for r, m in c.ranks.items() if m.host == host)
    idle = [m for m in c.procs.values() if m.role == "spare" and m.rank is None and m.ready]
    holding = {m.host for m in c.ranks.values()}  # a spare beside ranks serves only its host
    spares = [(m.worker_id, m.host) for m in idle if m.connected and m.host not in holding]
    if not h.remote or len(pick_spares(len(ranks), spares)) < len(ranks):
        if host not in c.stragglers.due_moves:
            c._log(
                "warning",
                f"not moving ranks {ranks} yet: no spare host ready for all of them (tried again at each step)",
            )
        c.stragglers.due_moves[host] = ratio
        return False
    c.stragglers.due_moves.pop(host, None)
    why = f"straggler host: busy {ratio:.2f}x the others; its ranks move to a spare host"
    c._emit("straggler_swap", host=host, address=h.address, ranks=ranks)
    # Kill, not _kill: these are moved, not hung; the host-loss path counts them as killed
    for m in [m for m in c.procs.values() if m.host == host]:
        c._out.append(Kill(m.worker_id, why, m.host))
    host_lost(c, host, why, now, wall)
    return True
