"""The peer table at a worker's end of the link: chunks taken in, plans filled in.

The link's reader thread keeps the peer table (``peer_table.TableHolder``): ``peer_table`` chunks
never reach the inbox, and a ``recover`` reaches it with its peer table and plan filled in; one
whose delta does not apply to the table held here is kept back while the full table is asked
for, unless this host's agent already holds a good copy of that version (``protocol/tables.py``).
Kept apart from the connection itself (``link.py``): :class:`PlanTables` owns the table's
bookkeeping, run on the reader thread as each frame arrives; the link gives it the two things it
needs from the connection (a way to ask the coordinator, and a way to hand on a plan that waited).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from checkpointless.events import get_logger
from checkpointless.peer_table import TableChunk, TableHolder
from checkpointless.protocol import Message, PeerTable, PeerTableRequest, Recover, encode
from checkpointless.protocol.tables import read_table, table_path

__all__ = ["PlanTables"]

log = get_logger()
_HOST_TABLE_WAIT_S = 1.0  # how long a plan waits for its host's copy of the table to appear


class PlanTables:
    """The worker's peer table and the plan held back for it (the reader thread's alone).

    ``send`` asks the coordinator for the full table; ``release`` hands on a plan that waited
    for its table once the table is whole; ``host_tables`` is the folder of this host's copies
    (``protocol/tables.py``), or None when the agent keeps none."""

    def __init__(
        self,
        send: Callable[[Message], None],
        release: Callable[[Recover], None],
        host_tables: Path | None,
    ) -> None:
        self._send = send
        self._release = release
        self._tables = host_tables
        self.table = TableHolder()
        self._held: Recover | None = None  # a recover waiting for the full table
        self._asked = 0  # full tables asked for in a row that did not arrive intact

    def resolve(self, msg: Recover) -> Recover | None:
        """The plan with its peer table filled in, or None when it must wait for the table."""
        try:
            resolved = self.table.resolve(encode(msg))
        except (ValueError, TypeError, KeyError) as e:  # TableError is a ValueError
            # a plan we cannot read: pass it on as it is, so that joining it fails and is
            # reported as this round's failure (never a dead reader thread)
            log.warning("cannot read the plan for generation %d: %s", msg.generation, e)
            self._held = None
            return msg
        if resolved is None and self._from_host(msg):
            resolved = self.table.resolve(encode(msg))
        if resolved is None:
            # a delta for a table we do not hold (or that would not match its digest), and no
            # good copy on this host: never meet peers at guessed addresses; ask for all of it
            log.info(
                "peer table v%d does not apply to v%d here; asking for all of it",
                msg.table_version,
                self.table.version,
            )
            self._held = msg
            self._send(PeerTableRequest(have=self.table.version))
            return None
        self._held = None
        # (the plan arrived typed and expanded: only the peer table is filled in here)
        return dataclasses.replace(msg, rendezvous=resolved["rendezvous"])

    def _from_host(self, msg: Recover) -> bool:
        """Take the plan's table version from the copy this host's agent keeps (protocol/tables.py),
        checked against the plan's digest. The agent gets it on a connection of its own, sent
        just before our plan: a copy not there yet is waited for briefly (on this reader thread,
        which has nothing else to do while it has no plan to hand on) when the coordinator must
        have sent one (we hold no table, or the plan carries no delta); a worker that merely
        missed a delta looks once and asks."""
        if self._tables is None or msg.table_version < 0:
            return False
        path = table_path(self._tables, msg.table_version)
        expected = self.table.version < 0 or msg.table_base < 0
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
                peers = read_table(self._tables, msg.table_version, msg.table_digest)
                if peers is not None:
                    self.table.adopt(msg.table_version, peers)
                    return True
            # not there yet, or another table of that number (a coordinator elected after a
            # failover numbers from 1 again, and its copy may still be on its way)
            if time.monotonic() >= deadline:
                log.info("no good copy of peer table v%d on this host", msg.table_version)
                return False
            time.sleep(0.005)

    def on_chunk(self, m: PeerTable) -> None:
        try:
            done = self.table.on_chunk(
                m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs)
            )
        except ValueError as e:  # TableError is a ValueError
            self._asked += 1
            if self._asked > 3:  # the coordinator keeps sending a broken table: stop asking
                log.error(
                    "peer table still broken after %d tries (%s); waiting for a new plan", self._asked, e
                )
                return
            log.warning("bad peer table chunk (%s); asking again", e)
            self._send(PeerTableRequest(have=self.table.version))
            return
        if done:
            self._asked = 0
        held = self._held
        if done and held is not None:
            self._held = None
            self._release(held)  # the plan that waited for this table
