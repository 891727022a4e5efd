"""The peer table kept once per host, in the job's shared memory, for every worker of the host.

The file's format, shared by both ends, so it lives below them: the host's agent writes it
(:class:`TableFiles`, ``agent/agent.py``) and the worker reads it (:func:`read_table`,
``recovery/link_table.py``).

Why: a root-less rendezvous needs every member to hold every rank's key-server address, and a
member that holds no table yet (every member at start-up, a spare that takes a rank) used to get
all of it over its own control connection. At 10k hosts x 8 ranks that is 80,000 copies of a
~330 KB table leaving the coordinator as the job starts (~26 GB, and 1.7 s of its CPU to queue).
Now the coordinator sends each *host* the table once per version (to its agent, as the same
``PeerTable`` chunks), the agent checks it (every chunk fits, the digest matches) and writes it
into ``<job shm dir>/peers/v<version>``, and a worker whose plan names a version it does not hold
reads it there (:func:`read_table`), checks it again against the digest its plan carries, and only
when that fails asks the coordinator for its own copy, as before. 8x fewer bytes and sends at 8
ranks per host.

The file holds the chunks as they came (runs of consecutive ports, not one address per rank), is
written whole under a temporary name and renamed, in a directory only this user can use (as the
heartbeat records: a planted table would send a worker to a stranger's key server), and the agent
keeps the two versions written last (a worker may still be reading the one before).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checkpointless.events import get_logger
from checkpointless.peer_table import TableChunk, TableError, TableHolder, assemble, table_digest
from checkpointless.protocol.beats import make_beat_dir
from checkpointless.protocol.worker_link import PeerTable

__all__ = ["TABLE_ENV", "TableFiles", "read_table", "table_path"]

log = get_logger()

TABLE_ENV = "CHECKPOINTLESS_PEER_TABLES"  # the directory a worker reads its host's tables from
_KEEP = 2  # versions kept on a host
_MAX_BYTES = 64 << 20  # a table file larger than this is not ours (80k ranks: ~0.4 MB)


def _same_table(a: PeerTable, b: PeerTable) -> bool:
    return (a.version, a.digest, a.world_size) == (b.version, b.digest, b.world_size)


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def table_path(directory: Path, version: int) -> Path:
    return directory / f"v{version}"


class TableFiles:
    """An agent's side: assembles the chunks the coordinator sends and writes each whole table.

    Driven by the agent's message loop (one thread); does no I/O but the directory's files."""

    def __init__(self, directory: Path) -> None:
        self.directory = make_beat_dir(directory)
        self._building: list[PeerTable] = []
        self._holder = TableHolder()  # checks each table as it is built
        self._recent: list[int] = []  # the versions kept, oldest first

    def on_chunk(self, msg: PeerTable) -> int | None:
        """Take one chunk; the version written once a whole table has arrived intact, else None.
        A broken table is dropped (logged): its workers then ask the coordinator themselves."""
        if msg.first == 0:
            self._building = []
        elif not self._building or not _same_table(self._building[-1], msg):
            return None  # the rest of a table given up on: wait for the next table's first chunk
        self._building.append(msg)
        try:
            done = self._holder.on_chunk(
                msg.version, msg.digest, msg.world_size, TableChunk(msg.first, msg.hosts, msg.runs)
            )
        except TableError as e:
            log.warning("dropped the coordinator's peer table v%d for this host: %s", msg.version, e)
            self._building = []
            return None
        if not done:
            return None
        chunks, self._building = self._building, []
        self._write(msg.version, msg.digest, msg.world_size, chunks)
        return msg.version

    def _write(self, version: int, digest: str, world_size: int, chunks: list[PeerTable]) -> None:
        body = {
            "version": version,
            "digest": digest,
            "world_size": world_size,
            "chunks": [{"first": c.first, "hosts": c.hosts, "runs": c.runs} for c in chunks],
        }
        path = table_path(self.directory, version)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, separators=(",", ":"))
            os.replace(tmp, path)  # whole or not at all: a reader never sees half a table
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("cannot keep peer table v%d for this host's workers: %s", version, e)
            return
        # the two written last, not the two highest: a coordinator elected after a failover
        # numbers its tables from 1 again (a file of the same number from before is refused by
        # its digest, never taken for the new table)
        older = [v for v in self._recent if v != version]
        self._recent = [*older[len(older) - (_KEEP - 1) :], version]
        keep = {table_path(self.directory, v).name for v in self._recent}
        for old in self.directory.glob("v*"):
            if old.name not in keep:
                old.unlink(missing_ok=True)


def read_table(directory: Path, version: int, digest: str) -> list[str] | None:
    """The peer table of ``version`` from the host's copy, checked against ``digest`` (the one the
    worker's plan carries); None when there is none or it does not check out (the caller then
    asks the coordinator for its own)."""
    try:
        # never through a link, never someone else's file, never an unbounded read
        with open(table_path(directory, version), "rb", opener=_nofollow) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_size > _MAX_BYTES:
                return None
            body: Any = json.loads(f.read())
    except (OSError, ValueError):
        return None
    try:
        if body["version"] != version or body["digest"] != digest:
            return None
        chunks = [TableChunk(int(c["first"]), list(c["hosts"]), list(c["runs"])) for c in body["chunks"]]
        peers = assemble(chunks, int(body["world_size"]))
    except (KeyError, TypeError, ValueError):  # TableError is a ValueError
        return None
    return peers if table_digest(peers) == digest else None
