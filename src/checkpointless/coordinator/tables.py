"""The peer table as the coordinator hands it out: chunks built once per version, the whole
table to one member, or a host's copy for all the members of that host.

The table itself (versions, deltas, who holds what) is ``peer_table.TableKeeper``'s; this is only
its delivery, kept apart from the coordinator's state machine because it is the one place that
weighs one message per member against one per host (``agent/tables.py`` holds the host's copy).
Functions of the :class:`Coordinator` they act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointless.coordinator.state import HostTable, Member
from checkpointless.protocol import PeerTable

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator


__all__ = ["give_table", "send_table", "table_chunks"]


def table_chunks(c: Coordinator) -> list[PeerTable]:
    """The current table as messages: built once per version, for every member and host."""
    t = c.table
    if c._table_msgs[0] != t.version:
        msgs = [
            PeerTable(t.version, t.digest, len(t.peers), ch.first, ch.hosts, ch.runs) for ch in t.chunks()
        ]
        c._table_msgs = (t.version, msgs)
    return c._table_msgs[1]


def send_table(c: Coordinator, m: Member) -> None:
    """The whole peer table to one member, in chunks (peer_table.py)."""
    t = c.table
    if t.version == 0:
        return  # no plan yet: its first Recover brings the table
    for chunk in table_chunks(c):
        c._send(m, chunk)
    c.table_sends += 1
    if m.connected and not m.exited:  # _send drops what a closed connection cannot take
        t.sent(m.worker_id)


def give_table(c: Coordinator, m: Member) -> None:
    """Bring a member that needs the whole table up to the current version: through its host's
    copy (agent/tables.py), sent to the agent once per version for all its workers; the member
    reads it there when its plan arrives, and asks us itself (``PeerTableRequest``) only when
    that copy fails it. A member of a host we do not know as live gets its own copy."""
    t = c.table
    h = c.hosts.get(m.host)
    if h is None or h.lost or t.version == 0:
        send_table(c, m)
        return
    if h.table_version != t.version:
        h.table_version = t.version
        c._out.append(HostTable(h.host, tuple(table_chunks(c))))
        c.host_tables += 1
    if m.connected and not m.exited:
        t.sent(m.worker_id)
