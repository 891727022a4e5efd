"""The peer table at a worker's end of the link: chunks taken in, plans filled in.

The link's reader thread keeps the peer table (``peer_table.TableHolder``): ``peer_table`` chunks
never reach the inbox, and a ``recover`` reaches it with its peer table and plan filled in; one
whose delta does not apply to the table held here is kept back while the full table is asked
for, unless this host's agent already holds a good copy of that version (``agent/tables.py``).
Kept apart from the connection itself (``link.py``): this is the table's bookkeeping, run on the
reader thread as each frame arrives. Functions of the
:class:`~checkpointless.recovery.link.LauncherLink` they act on.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from checkpointless.agent.tables import read_table, table_path
from checkpointless.events import get_logger
from checkpointless.peer_table import TableChunk
from checkpointless.protocol import PeerTable, PeerTableRequest, Recover, encode

if TYPE_CHECKING:
    from checkpointless.recovery.link import LauncherLink

__all__ = ["on_table_chunk", "resolve"]

log = get_logger()
_HOST_TABLE_WAIT_S = 1.0  # how long a plan waits for its host's copy of the table to appear


def resolve(link: LauncherLink, msg: Recover) -> Recover | None:
    """The plan with its peer table filled in, or None when it must wait for the table."""
    try:
        resolved = link.table.resolve(encode(msg))
    except (ValueError, TypeError, KeyError) as e:  # TableError is a ValueError
        # a plan we cannot read: pass it on as it is, so that joining it fails and is
        # reported as this round's failure (never a dead reader thread)
        log.warning("cannot read the plan for generation %d: %s", msg.generation, e)
        link._held = None
        return msg
    if resolved is None and _from_host(link, msg):
        resolved = link.table.resolve(encode(msg))
    if resolved is None:
        # a delta for a table we do not hold (or that would not match its digest), and no
        # good copy on this host: never meet peers at guessed addresses; ask for all of it
        log.info(
            "peer table v%d does not apply to v%d here; asking for all of it",
            msg.table_version,
            link.table.version,
        )
        link._held = msg
        link.send(PeerTableRequest(have=link.table.version))
        return None
    link._held = None
    return dataclasses.replace(msg, plan=resolved["plan"], rendezvous=resolved["rendezvous"])


def _from_host(link: LauncherLink, msg: Recover) -> bool:
    """Take the plan's table version from the copy this host's agent keeps (agent/tables.py),
    checked against the plan's digest. The agent gets it on a connection of its own, sent just
    before our plan: a copy not there yet is waited for briefly (on this reader thread, which
    has nothing else to do while it has no plan to hand on) when the coordinator must have
    sent one (we hold no table, or the plan carries no delta); a worker that merely missed a
    delta looks once and asks."""
    if link._tables is None or msg.table_version < 0:
        return False
    path = table_path(link._tables, msg.table_version)
    expected = link.table.version < 0 or msg.table_base < 0
    deadline = time.monotonic() + (_HOST_TABLE_WAIT_S if expected else 0.0)
    seen: tuple[int, int, int] | None = None
    while True:
        try:
            st = path.stat()
            now = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        if now is not None and now != seen:  # there, or replaced: (re)read it
            seen = now
            peers = read_table(link._tables, msg.table_version, msg.table_digest)
            if peers is not None:
                link.table.adopt(msg.table_version, peers)
                return True
        # not there yet, or another table of that number (a coordinator elected after a
        # failover numbers from 1 again, and its copy may still be on its way)
        if time.monotonic() >= deadline:
            log.info("no good copy of peer table v%d on this host", msg.table_version)
            return False
        time.sleep(0.005)


def on_table_chunk(link: LauncherLink, m: PeerTable) -> None:
    try:
        done = link.table.on_chunk(m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs))
    except ValueError as e:  # TableError is a ValueError
        link._asked += 1
        if link._asked > 3:  # the coordinator keeps sending a broken table: stop asking
            log.error("peer table still broken after %d tries (%s); waiting for a new plan", link._asked, e)
            return
        log.warning("bad peer table chunk (%s); asking again", e)
        link.send(PeerTableRequest(have=link.table.version))
        return
    if done:
        link._asked = 0
    held = link._held
    if done and held is not None:
        link._held = None
        link._dispatch(held)  # the plan that waited for this table
