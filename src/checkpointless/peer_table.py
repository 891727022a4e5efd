"""Peer tables and recovery plans small enough for the control channel at any job size.

A root-less rendezvous needs every member to know every rank's key-server address (``host:port``).
Listing them in each ``Recover`` made that message grow by ~20 bytes per rank, past the 64 KiB
control-frame cap at ~3,500 ranks. Instead:

* the *full table* travels rarely (a member's first plan, or on request) as ``PeerTable`` chunks,
  each a few KiB of *runs*: ``[first rank, count, host index, first port]`` stands for ``count``
  ranks on one host with consecutive ports, which is what host-major placement and an agent's port
  allocator produce, so a host of 8 ranks costs one run;
* every later ``Recover`` carries only the ranks whose address changed (a lost host's ranks, now on
  a spare host) plus the table's new *version* and *digest*; a member that does not hold the
  version the delta applies to, or whose result does not match the digest, asks for the full table
  instead of meeting a wrong peer;
* a plan's receiver list and (sharded) source pairs travel as ranges and runs for the same reason.

Everything here is a pure function of its arguments (tested in ``tests/unit/protocol/test_peer_table.py``);
:class:`TableHolder` is the worker's state, driven by messages, and does no I/O itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHUNK_BYTES",
    "DELTA_LIMIT",
    "PLAIN_LIST_LIMIT",
    "TableChunk",
    "TableError",
    "TableHolder",
    "TableKeeper",
    "apply_delta",
    "assemble",
    "compact_plan",
    "diff",
    "encode_chunks",
    "expand_plan",
    "expand_ranges",
    "ranges_of",
    "table_digest",
]

# JSON budget of one chunk (runs plus its host names). The control header cap is 64 KiB; a chunk
# stays at half of it so the frame's own fields never push it over.
CHUNK_BYTES = 32 << 10
# A round that moves more ranks than this sends the full table instead of a delta: a delta entry
# costs ~25 bytes, so 1,024 of them stay under CHUNK_BYTES as well.
DELTA_LIMIT = 1024
# a plan's rank lists up to this long travel as they are; longer ones as ranges and runs
PLAIN_LIST_LIMIT = 64


class TableError(ValueError):
    """A chunk or delta that does not fit the table being built (out of order, malformed)."""


def table_digest(peers: Sequence[str]) -> str:
    """A short hash of the whole table: equal digests mean the worker meets the right peers."""
    return hashlib.blake2b("\n".join(peers).encode(), digest_size=12).hexdigest()


def _split(address: str) -> tuple[str, int]:
    """``host:port`` as (host, port); anything else as (the address verbatim, -1)."""
    host, sep, port = address.rpartition(":")
    # only a canonical decimal port may be taken apart: "h:007" must come back as "h:007"
    if sep and port.isdigit() and str(int(port)) == port:
        return host, int(port)
    return address, -1


@dataclass(frozen=True)
class TableChunk:
    """Ranks ``first`` .. of a table: ``runs`` index into this chunk's own ``hosts``."""

    first: int
    hosts: list[str]
    runs: list[list[int]]


def _runs(peers: Sequence[str]) -> list[tuple[int, int, str, int]]:
    """(first rank, count, host, first port) runs; port -1: every rank in it has ``host`` verbatim."""
    out: list[tuple[int, int, str, int]] = []
    for rank, address in enumerate(peers):
        host, port = _split(address)
        if out:
            first, count, h, p = out[-1]
            if h == host and ((p < 0 and port < 0) or (p >= 0 and port == p + count)):
                out[-1] = (first, count + 1, h, p)
                continue
        out.append((rank, 1, host, port))
    return out


def encode_chunks(peers: Sequence[str], budget: int = CHUNK_BYTES) -> list[TableChunk]:
    """The whole table as chunks of at most ~``budget`` bytes of JSON each (at least one chunk)."""
    chunks: list[TableChunk] = []
    hosts: dict[str, int] = {}
    runs: list[list[int]] = []
    first, size = 0, 0
    for start, count, host, port in _runs(peers):
        # the run's JSON, plus the host's own JSON (escapes and all) when the chunk lacks it
        named = len(json.dumps(host)) + 1
        cost = len(f"[{start},{count},{len(hosts)},{port}],") + (0 if host in hosts else named)
        if runs and size + cost > budget:
            chunks.append(TableChunk(first, list(hosts), runs))
            hosts, runs, first, size = {}, [], start, 0
            cost = len(f"[{start},{count},0,{port}],") + named
        idx = hosts.setdefault(host, len(hosts))
        runs.append([start, count, idx, port])
        size += cost
    chunks.append(TableChunk(first, list(hosts), runs))
    return chunks


def _expand(chunk: TableChunk, next_rank: int, world_size: int) -> list[str]:
    if chunk.first != next_rank:
        raise TableError(f"chunk starts at rank {chunk.first}, expected {next_rank}")
    out: list[str] = []
    for run in chunk.runs:
        if len(run) != 4:
            raise TableError(f"run {run} is not [first, count, host, port]")
        start, count, idx, port = run
        if start != next_rank + len(out) or count < 1 or not 0 <= idx < len(chunk.hosts) or port < -1:
            raise TableError(f"run {run} does not continue the table at rank {next_rank + len(out)}")
        if next_rank + len(out) + count > world_size:
            raise TableError(f"run {run} goes past the world size {world_size}")
        host = chunk.hosts[idx]
        if port < 0:
            out.extend([host] * count)
        else:
            out.extend(f"{host}:{port + i}" for i in range(count))
    return out


def assemble(chunks: Sequence[TableChunk], world_size: int) -> list[str]:
    """The table the chunks encode; :class:`TableError` if they do not cover it exactly."""
    out: list[str] = []
    for c in chunks:
        out.extend(_expand(c, len(out), world_size))
    if len(out) != world_size:
        raise TableError(f"the chunks cover {len(out)} of {world_size} ranks")
    return out


def diff(old: Sequence[str], new: Sequence[str]) -> list[tuple[int, str]]:
    """(rank, new address) for every rank whose address changed; [] if the sizes differ too."""
    if len(old) != len(new):
        raise TableError(f"tables of {len(old)} and {len(new)} ranks have no delta")
    return [(r, b) for r, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]


def apply_delta(old: Sequence[str], ranks: Sequence[int], addresses: Sequence[str]) -> list[str]:
    if len(ranks) != len(addresses):
        raise TableError(f"a delta of {len(ranks)} ranks and {len(addresses)} addresses")
    out = list(old)
    for r, a in zip(ranks, addresses, strict=True):
        if not 0 <= r < len(out):
            raise TableError(f"delta names rank {r} of a table of {len(out)}")
        out[r] = a
    return out


# -- plans ------------------------------------------------------------------------------------------
def ranges_of(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted, distinct ranks as half-open ranges [[start, stop], ...]."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def expand_ranges(ranges: Sequence[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for pair in ranges:
        if len(pair) != 2 or pair[1] < pair[0] or pair[0] < 0:
            raise TableError(f"range {list(pair)} is not [start, stop]")
        out.extend(range(pair[0], pair[1]))
    return out


def _pair_runs(pairs: Sequence[Sequence[int]]) -> list[list[int]]:
    """(receiver, source) pairs as runs [receiver, count, source, source step, repeats]: ``repeats``
    blocks of ``count`` consecutive receivers, each block taking sources ``source``,
    ``source + step``, ... A sharded job's first plan (rank r takes shard r % S from rank r % S)
    is one run whatever the job's size."""
    runs: list[list[int]] = []
    for recv, src in pairs:
        if runs:
            r0, n, s0, ds = runs[-1]
            if recv == r0 + n and (n == 1 or src == s0 + ds * n):
                runs[-1] = [r0, n + 1, s0, src - s0 if n == 1 else ds]
                continue
        runs.append([recv, 1, src, 0])
    out: list[list[int]] = []
    for r0, n, s0, ds in runs:
        if out:
            p0, pn, ps, pds, reps = out[-1]
            if (pn, ps, pds) == (n, s0, ds) and r0 == p0 + pn * reps:
                out[-1][4] = reps + 1
                continue
        out.append([r0, n, s0, ds, 1])
    return out


def _expand_pair_runs(runs: Sequence[Sequence[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for run in runs:
        if len(run) != 5 or run[1] < 1 or run[4] < 1:
            raise TableError(f"source run {list(run)} is not [receiver, count, source, step, repeats]")
        r0, n, s0, ds, reps = run
        out.extend([r0 + k * n + i, s0 + ds * i] for k in range(reps) for i in range(n))
    return out


def compact_plan(plan: dict[str, Any], keep: int = PLAIN_LIST_LIMIT) -> dict[str, Any]:
    """A plan's JSON (``RecoveryPlan.to_json``) with its per-rank lists as ranges and runs once
    they are longer than ``keep`` entries (short ones stay as they are, readable)."""
    out = dict(plan)
    if len(out.get("receivers", [])) > keep:
        out["receiver_ranges"] = ranges_of(out.pop("receivers"))
    if len(out.get("sources", [])) > keep:
        out["source_runs"] = _pair_runs(out.pop("sources"))
    return out


def expand_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`compact_plan` (a plan already expanded comes back unchanged)."""
    out = dict(plan)
    if "receiver_ranges" in out:
        out["receivers"] = expand_ranges(out.pop("receiver_ranges"))
    if "source_runs" in out:
        out["sources"] = _expand_pair_runs(out.pop("source_runs"))
    return out


# -- the coordinator's side ---------------------------------------------------------------------------
class TableKeeper:
    """The coordinator's copy of the table: its version, the change from the last version (when
    it is small enough to send as a delta) and the version each process was brought up to.

    The control connection is ordered and reliable, so what was sent is what a process holds,
    unless it reconnected or a message was dropped; a worker checks the digest either way."""

    def __init__(self) -> None:
        self.peers: list[str] = []
        self.version = 0  # 0: no table yet
        self.base = -1  # the version ``moved`` applies to; -1: none
        self.digest = table_digest([])
        self.moved: list[tuple[int, str]] = []
        self.held: dict[int, int] = {}  # worker id -> version
        self._chunks: list[TableChunk] | None = None

    def update(self, peers: list[str]) -> None:
        """A new version when any address changed; a delta from the last one when it is small."""
        if peers == self.peers:
            self.base, self.moved = self.version, []
            return
        moved = diff(self.peers, peers) if self.peers and len(peers) == len(self.peers) else None
        small = moved is not None and len(moved) <= DELTA_LIMIT
        self.base = self.version if small else -1
        self.moved = moved if moved is not None and small else []
        self.version += 1
        self.peers = list(peers)
        self.digest = table_digest(self.peers)
        self._chunks = None

    def needs_full(self, worker_id: int) -> bool:
        held = self.held.get(worker_id, -1)
        return held != self.version and not (self.base >= 0 and held == self.base)

    def chunks(self) -> list[TableChunk]:
        """The current table as chunks, built once per version."""
        if self._chunks is None:
            self._chunks = encode_chunks(self.peers)
        return self._chunks

    def sent(self, worker_id: int) -> None:
        """This process now holds the current version (its chunks or delta are on their way)."""
        self.held[worker_id] = self.version

    def forget(self, worker_id: int) -> None:
        self.held.pop(worker_id, None)


# -- the worker's side ------------------------------------------------------------------------------
class TableHolder:
    """The peer table one worker holds, its version, and a full table being received.

    :meth:`resolve` turns a received ``recover`` message into the one the recovery code reads
    (``rendezvous.peers`` filled in, the plan expanded), or returns None when this worker must ask
    for the full table first. :meth:`on_chunk` returns True once a full table has arrived intact.
    """

    def __init__(self) -> None:
        self.version = -1  # none yet
        self.peers: list[str] = []
        self.digest = ""  # of ``peers``
        self._building: tuple[int, str, int] | None = None  # version, digest, world size
        self._parts: list[str] = []

    def on_chunk(self, version: int, digest: str, world_size: int, chunk: TableChunk) -> bool:
        if chunk.first == 0:  # a table starts: whatever was being built is superseded
            self._building, self._parts = (version, digest, world_size), []
        elif self._building != (version, digest, world_size):
            return False  # the rest of a table given up on (or superseded): wait for a first chunk
        try:
            self._parts.extend(_expand(chunk, len(self._parts), world_size))
        except TableError:
            self._building, self._parts = None, []
            raise
        if len(self._parts) < world_size:
            return False
        parts, self._building, self._parts = self._parts, None, []
        if table_digest(parts) != digest:
            raise TableError(f"full table version {version} does not match its digest")
        self.version, self.peers, self.digest = version, parts, digest
        return True

    def adopt(self, version: int, peers: list[str]) -> None:
        """Hold ``peers`` as ``version`` (a whole table already checked against its digest)."""
        self._building, self._parts = None, []
        self.version, self.peers, self.digest = version, list(peers), table_digest(peers)

    def resolve(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        out = dict(msg)
        out["plan"] = expand_plan(dict(msg.get("plan", {})))
        desc = dict(msg.get("rendezvous", {}))
        version = int(msg.get("table_version", -1))
        if desc.get("kind") != "rootless" or version < 0 or "peers" in desc:
            out["rendezvous"] = desc  # no table to keep (--rendezvous tcp), or an inline one
            return out
        digest = msg.get("table_digest")
        if self.version == version and digest and digest != self.digest:
            # the same number for another table: a coordinator elected after a failover numbers
            # its tables from 1 again. Never trust a number alone
            return None
        if self.version != version:
            base = int(msg.get("table_base", -1))
            if base < 0 or self.version != base:
                return None  # a delta we cannot apply: ask for the whole table
            try:
                peers = apply_delta(self.peers, msg.get("moved_ranks", []), msg.get("moved_to", []))
            except TableError:
                return None
            if table_digest(peers) != msg.get("table_digest"):
                return None
            self.version, self.peers, self.digest = version, peers, str(digest)
        desc["peers"] = list(self.peers)
        out["rendezvous"] = desc
        return out
