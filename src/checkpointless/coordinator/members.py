"""Who is in the job: the hosts (agents) seen, every live process by worker id, and which process
holds each rank. The other components read these tables and change a member's fields; only
:class:`Members` adds processes (:meth:`Members.spawn`) and hands out worker ids.
"""

from __future__ import annotations

from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.state import HostState, Member

__all__ = ["Members"]


class Members:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.procs: dict[int, Member] = {}  # live processes, by worker id
        self.ranks: dict[int, Member] = {}  # rank -> the process holding it
        self.hosts: dict[int, HostState] = {}  # agent id -> its host (one machine: host 0 only)
        self.next_worker_id = 0

    def spawn(self, role: str, now: float, host: int) -> Member:
        """A new process on ``host``: recorded here, and its ``Spawn`` queued for the shell."""
        wid = self.next_worker_id
        self.next_worker_id += 1
        m = Member(worker_id=wid, role=role, spawned=now, host=host)
        self.procs[wid] = m
        self.outbox.spawn(wid, role, host)
        return m

    def live_hosts(self) -> set[int]:
        return {h.host for h in self.hosts.values() if not h.lost}

    def idle_spares(self) -> list[Member]:
        """Spares that hold no rank (ready or still starting, a retired one included)."""
        return [m for m in self.procs.values() if m.role == "spare" and m.rank is None]

    def rank_hosts(self) -> set[int]:
        """The hosts that hold ranks."""
        return {m.host for m in self.ranks.values()}

    def live_connected(self) -> list[int]:
        return [m.worker_id for m in self.procs.values() if m.connected and not m.exited]
