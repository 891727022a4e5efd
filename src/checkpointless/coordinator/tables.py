"""The peer table as the coordinator hands it out: chunks built once per version, the whole
table to one member, or a host's copy for all the members of that host.

The table itself (versions, deltas, who holds what) is ``peer_table.TableKeeper``'s; this is its
delivery, the one place that weighs one message per member against one per host
(``protocol/tables.py`` holds the host's copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.state import Member
from checkpointless.peer_table import TableKeeper
from checkpointless.protocol import PeerTable

__all__ = ["PlanTable", "TableDelivery"]


@dataclass(frozen=True)
class PlanTable:
    """The table's fields of a ``Recover``, and the whole tables sent for it."""

    version: int
    base: int
    digest: str
    moved_ranks: list[int]
    moved_to: list[str]
    host_tables: int  # whole tables sent to hosts' agents for this plan
    member_tables: int  # ... and to single members


class TableDelivery:
    def __init__(self, members: Members, outbox: Outbox) -> None:
        self.members = members  # its hosts: read, and each host's table version set
        self.outbox = outbox
        self.keeper = TableKeeper()  # the root-less peer table as the members hold it
        self.msgs: tuple[int, list[PeerTable]] = (0, [])
        self.table_sends = 0  # whole tables sent to one member (start-up without a host copy, requests)
        self.host_tables = 0  # whole tables sent to a host's agent for its members

    def chunks(self) -> list[PeerTable]:
        """The current table as messages: built once per version, for every member and host."""
        t = self.keeper
        if self.msgs[0] != t.version:
            msgs = [
                PeerTable(t.version, t.digest, len(t.peers), ch.first, ch.hosts, ch.runs) for ch in t.chunks()
            ]
            self.msgs = (t.version, msgs)
        return self.msgs[1]

    def forget(self, worker_id: int) -> None:
        self.keeper.forget(worker_id)

    def send_table(self, m: Member) -> None:
        """The whole peer table to one member, in chunks (peer_table.py)."""
        t = self.keeper
        if t.version == 0:
            return  # no plan yet: its first Recover brings the table
        for chunk in self.chunks():
            self.outbox.send(m, chunk)
        self.table_sends += 1
        if m.connected and not m.exited:  # the outbox drops what a closed connection cannot take
            t.sent(m.worker_id)

    def give_table(self, m: Member) -> None:
        """Bring a member that needs the whole table up to the current version: through its host's
        copy (protocol/tables.py), sent to the agent once per version for all its workers; the member
        reads it there when its plan arrives, and asks us itself (``PeerTableRequest``) only when
        that copy fails it. A member of a host we do not know as live gets its own copy."""
        t = self.keeper
        h = self.members.hosts.get(m.host)
        if h is None or h.lost or t.version == 0:
            self.send_table(m)
            return
        if h.table_version != t.version:
            h.table_version = t.version
            self.outbox.host_table(h.host, tuple(self.chunks()))
            self.host_tables += 1
        if m.connected and not m.exited:
            t.sent(m.worker_id)

    def for_plan(self, ranks: dict[int, Member], nproc: int) -> PlanTable:
        """The table for a plan that goes out now: updated to the ranks' addresses, and the whole
        table given first to each member that does not hold the version the delta applies to."""
        t = self.keeper
        t.update([ranks[k].store_address for k in range(nproc)])
        sends, hosts = self.table_sends, self.host_tables
        for m in ranks.values():
            if t.needs_full(m.worker_id):
                self.give_table(m)
            elif m.connected and not m.exited:
                t.sent(m.worker_id)
        return PlanTable(
            t.version,
            t.base,
            t.digest,
            [rank for rank, _ in t.moved],
            [address for _, address in t.moved],
            self.host_tables - hosts,
            self.table_sends - sends,
        )

    def without_table(self, ranks: dict[int, Member]) -> PlanTable:
        """A plan without a root-less table: no table in it, still a delivery the keeper counts."""
        t = self.keeper
        for m in ranks.values():
            if m.connected and not m.exited:
                t.sent(m.worker_id)
        return PlanTable(-1, -1, "", [rank for rank, _ in t.moved], [address for _, address in t.moved], 0, 0)
