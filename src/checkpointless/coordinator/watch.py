"""Straggler hosts between faults: hosts whose steps run persistently slower than the others'
are reported, and with --swap-stragglers their ranks move to a spare host by the host-loss path.
The rule itself is ``rules/stragglers.py``'s :class:`StragglerWatch`.
"""

from __future__ import annotations

from checkpointless.coordinator.losses import Losses
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.placement import pick_spares
from checkpointless.coordinator.rules.stragglers import RankTiming, StragglerWatch
from checkpointless.settings import JobSettings as LaunchConfig

__all__ = ["StragglerMoves"]


class StragglerMoves:
    def __init__(
        self, cfg: LaunchConfig, watch: StragglerWatch, members: Members, outbox: Outbox, losses: Losses
    ) -> None:
        self.cfg = cfg
        self.watch = watch
        self.members = members
        self.outbox = outbox
        self.losses = losses

    def check(self, now: float, wall: float, changing: bool) -> None:
        """Report a host whose ranks are persistently slower than the others; with
        --swap-stragglers, move its ranks to a spare host by the host-loss path: its workers are
        killed, the host is fenced, spares take the ranks. ``changing``: a round is open or its
        first step is not done everywhere.

        A straggler reported while no spare host is ready for all its ranks (the spares still
        starting, say) stays due for a move: it is tried again at each new step until it succeeds
        or the host is cleared, since the rule reports a host once, not at every slow step."""
        watch, ms, out = self.watch, self.members, self.outbox
        if changing:
            watch.reset()  # the members are changing: a window must not span a recovery
            return
        if any(m.done for m in ms.ranks.values()):
            return  # training is over: moving a host now would only fail a finished job
        timings = [RankTiming(m.host, r, m.step, m.busy_time) for r, m in ms.ranks.items()]
        sampled = watch.last_step
        for v, ranks in watch.observe(timings):
            h = ms.hosts[v.host]
            if not v.reported:
                watch.due_moves.pop(v.host, None)
                out.emit("straggler_cleared", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio)
                out.log("info", f"host {h.address} (ranks {ranks}) is no longer a straggler")
                continue
            window = [round(x, 3) for x in v.window]
            out.emit("straggler", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio, window=window)
            out.log(
                "warning",
                f"straggler host {h.address} (agent {v.host}, ranks {ranks}): busy {v.ratio:.2f}x the "
                f"other hosts' over the last {len(window)} steps",
            )
            if self.cfg.swap_stragglers and self._move(v.host, v.ratio, now, wall):
                return
        if watch.last_step != sampled:  # a new step: try the moves still due (spares may be ready now)
            for host, ratio in sorted(watch.due_moves.items()):
                if self._move(host, ratio, now, wall):
                    return

    def _move(self, host: int, ratio: float, now: float, wall: float) -> bool:
        """Move a straggler host's ranks to a spare host, or leave the move due (logged once)."""
        ms, out, due = self.members, self.outbox, self.watch.due_moves
        h = ms.hosts[host]
        ranks = sorted(r for r, m in ms.ranks.items() if m.host == host)
        idle = [m for m in ms.idle_spares() if m.ready]
        holding = ms.rank_hosts()  # a spare beside ranks serves only its host
        spares = [(m.worker_id, m.host) for m in idle if m.connected and m.host not in holding]
        if not h.remote or len(pick_spares(len(ranks), spares)) < len(ranks):
            if host not in due:
                out.log(
                    "warning",
                    f"not moving ranks {ranks} yet: no spare host ready for all of them (tried again at each step)",
                )
            due[host] = ratio
            return False
        due.pop(host, None)
        why = f"straggler host: busy {ratio:.2f}x the others; its ranks move to a spare host"
        out.emit("straggler_swap", host=host, address=h.address, ranks=ranks)
        # unjudged kills: these are moved, not hung; the host-loss path counts them as killed
        for m in [m for m in ms.procs.values() if m.host == host]:
            out.kill_unjudged(m.worker_id, why, m.host)
        self.losses.host_lost(host, why, now, wall)
        return True
