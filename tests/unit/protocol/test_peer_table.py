"""The peer table's wire forms (peer_table.py) as pure functions, and the coordinator's side of
them: whatever the table, the worker's rebuilt copy equals the coordinator's, every chunk and
every Recover fits the control-frame cap, and a worker that missed a delta asks for the whole
table instead of meeting a wrong peer; a host's agent keeps one checked copy of each version for
its workers (agent/tables.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.coordinator import HostTable, Send, Spawn
from checkpointless.peer_table import (
    CHUNK_BYTES,
    TableChunk,
    TableHolder,
    apply_delta,
    assemble,
    compact_plan,
    diff,
    encode_chunks,
    expand_plan,
    table_digest,
)
from checkpointless.protocol import (
    PeerTable,
    PeerTableRequest,
    Recover,
    Recovered,
    ResumePlan,
    SpareReady,
    Stopped,
    encode,
)
from checkpointless.protocol.control_channel import MAX_CONTROL_HEADER
from checkpointless.protocol.tables import TableFiles, read_table
from tests.helpers.coordinator import new_coordinator

hosts = st.sampled_from(["10.0.0.1", "10.0.0.2", "node-7.cluster", "::1", "[fe80::1]", "h:007", ""])
address = st.one_of(
    st.builds(lambda h, p: f"{h}:{p}", hosts, st.integers(0, 65535)),
    hosts,  # no port at all (kept verbatim)
    st.text(max_size=12),
)


def host_major(n_hosts: int, per_host: int, base: int) -> list[str]:
    return [f"10.1.{h // 256}.{h % 256}:{base + i}" for h in range(n_hosts) for i in range(per_host)]


tables = st.one_of(
    st.lists(address, min_size=1, max_size=300),
    st.builds(host_major, st.integers(1, 200), st.integers(1, 8), st.integers(20000, 30000)),
)


def holder_with(peers: list[str], version: int) -> TableHolder:
    h = TableHolder()
    done = False
    for c in encode_chunks(peers):
        done = h.on_chunk(version, table_digest(peers), len(peers), c)
    assert done
    return h


@settings(max_examples=200, deadline=None)
@given(tables, st.integers(200, 4000))
def test_chunks_rebuild_the_table_exactly_and_stay_within_budget(peers: list[str], budget: int) -> None:
    chunks = encode_chunks(peers, budget)
    assert assemble(chunks, len(peers)) == peers
    for c in chunks:
        msg = PeerTable(3, table_digest(peers), len(peers), c.first, c.hosts, c.runs)
        # one run may exceed a tiny budget by itself; the budget is otherwise respected
        size = len(json.dumps(encode(msg), separators=(",", ":")))  # as wire.py writes it
        assert size <= budget + 200 or len(c.runs) == 1
    holder = holder_with(peers, 3)
    assert holder.peers == peers and holder.version == 3


@settings(max_examples=200, deadline=None)
@given(tables, st.data())
def test_a_delta_rebuilds_the_new_table_and_a_missed_one_is_detected(peers: list[str], data: Any) -> None:
    n = len(peers)
    moved = data.draw(st.dictionaries(st.integers(0, n - 1), address, max_size=min(n, 20)))
    new = apply_delta(peers, list(moved), list(moved.values()))
    changes = diff(peers, new)
    assert apply_delta(peers, [r for r, _ in changes], [a for _, a in changes]) == new
    recover = encode(
        Recover(
            generation=2,
            rendezvous={"kind": "rootless", "timeout": 60},
            plan=ResumePlan(5, 0, receivers=[r for r, _ in changes]),
            table_version=2,
            table_base=1,
            table_digest=table_digest(new),
            moved_ranks=[r for r, _ in changes],
            moved_to=[a for _, a in changes],
        )
    )
    holder = holder_with(peers, 1)
    resolved = holder.resolve(recover)
    assert resolved is not None and resolved["rendezvous"]["peers"] == new and holder.version == 2
    assert resolved["plan"]["receivers"] == [r for r, _ in changes]
    # the same plan again (a resend): still fine, nothing applied twice
    again = holder.resolve(recover)
    assert again is not None and again["rendezvous"]["peers"] == new
    # a worker that holds another version (it missed a delta) must not guess
    stale = holder_with(peers, 0)
    assert stale.resolve(recover) is None and stale.version == 0
    # nor one whose table differs from the coordinator's under the same version number
    untouched = [r for r in range(n) if r not in moved]
    if untouched:
        other = list(peers)
        other[untouched[0]] += "x"
        assert holder_with(other, 1).resolve(recover) is None
    # nor one that holds the plan's version number for another table (a coordinator elected after
    # a failover numbers from 1 again): the number alone is never trusted
    if new != peers:
        assert holder_with(peers, 2).resolve(recover) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=400, unique=True),
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), max_size=300, unique_by=lambda p: p[0]),
)
def test_a_compact_plan_expands_to_the_original(receivers: list[int], pairs: list[tuple[int, int]]) -> None:
    plan: dict[str, Any] = {"target_step": 9, "source": 0, "receivers": sorted(receivers)}
    if pairs:
        plan["sources"] = [list(p) for p in sorted(pairs)]
    wire = compact_plan(plan, keep=4)
    assert expand_plan(json.loads(json.dumps(wire))) == plan


def test_a_plan_of_every_rank_is_a_few_bytes() -> None:
    plan = {"target_step": 0, "source": 0, "receivers": list(range(1, 80_000))}
    assert len(json.dumps(compact_plan(plan))) < 100


def test_chunks_of_80k_host_major_ranks_fit_the_cap() -> None:
    peers = host_major(10_000, 8, 29600)
    chunks = encode_chunks(peers)
    sizes = [
        len(
            json.dumps(
                encode(PeerTable(1, table_digest(peers), len(peers), c.first, c.hosts, c.runs)),
                separators=(",", ":"),
            )
        )
        for c in chunks
    ]
    assert max(sizes) < CHUNK_BYTES + 1024 < MAX_CONTROL_HEADER // 2 + 2048
    assert assemble([TableChunk(c.first, c.hosts, c.runs) for c in chunks], len(peers)) == peers


# -- the coordinator's side ----------------------------------------------------------------------
class Job:
    def __init__(self, nproc: int, spares: int = 2) -> None:
        self.c = new_coordinator(nproc, spares)
        self.now = 10.0
        self.workers: dict[int, TableHolder] = {}
        self.copies: dict[int, tuple[int, str, list[str]]] = {}  # host -> its agent's table
        self.c.start(self.now)
        self.out = self.flush()

    def flush(self) -> list[Any]:
        out = self.c.drain()
        for cmd in out:
            if isinstance(cmd, Spawn):
                self.c.on_started(cmd.worker_id, f"127.0.0.1:{30000 + cmd.worker_id}")
        return out

    def tick(self) -> list[Any]:
        self.now += 0.01
        self.c.tick(self.now, 1e9)
        return self.flush()

    def deliver(
        self, out: list[Any], drop: frozenset[int] = frozenset(), host_copy: bool = True
    ) -> dict[int, dict[str, Any] | None]:
        """Play each worker's link: chunks into its holder, each Recover resolved (None: it asks);
        and each agent's copy of the table (``HostTable``), which a worker whose plan names a
        version it does not hold takes when it is that version (``host_copy``: it has one)."""
        resolved: dict[int, dict[str, Any] | None] = {}
        for cmd in out:
            if isinstance(cmd, HostTable):
                c0 = cmd.chunks[0]
                parts = [TableChunk(c.first, c.hosts, c.runs) for c in cmd.chunks]
                self.copies[cmd.host] = (c0.version, c0.digest, assemble(parts, c0.world_size))
            if not isinstance(cmd, Send) or cmd.worker_id in drop:
                continue
            h = self.workers.setdefault(cmd.worker_id, TableHolder())
            m = cmd.message
            if isinstance(m, PeerTable):
                h.on_chunk(m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs))
            elif isinstance(m, Recover):
                got = h.resolve(encode(m))
                copy = self.copies.get(self.c.procs[cmd.worker_id].host)
                if (
                    got is None
                    and host_copy
                    and copy is not None
                    and copy[:2] == (m.table_version, m.table_digest)
                ):
                    h.adopt(m.table_version, copy[2])
                    got = h.resolve(encode(m))
                resolved[cmd.worker_id] = got
        return resolved


def test_every_member_meets_the_coordinators_table_through_two_rounds_and_a_missed_delta() -> None:
    j = Job(nproc=6)
    for wid in range(6):
        assert j.c.on_connected(wid, j.now)
    j.flush()
    for rank in range(6):
        j.c.on_message(
            rank, Stopped(for_generation=0, committed_step=0, valid=True, cause="start"), j.now, 1e9
        )
    out = j.tick()
    truth = [f"127.0.0.1:{30000 + w}" for w in range(6)]
    res = j.deliver(out)
    assert set(res) == set(range(6)) and all(
        r is not None and r["rendezvous"]["peers"] == truth for r in res.values()
    )
    for rank in range(6):
        j.c.on_message(rank, Recovered(generation=0), j.now, 1e9)
    for cmd in j.flush():
        if isinstance(cmd, Spawn):
            j.c.on_connected(cmd.worker_id, j.now)
    spares = [w for w, m in j.c.procs.items() if m.role == "spare"]
    for w in spares:
        j.c.on_message(w, SpareReady(), j.now, 1e9)
    j.flush()
    # rank 2's process dies; a spare takes it. Survivors get a one-rank delta, the spare the table.
    j.c.on_exit(2, -9, False, "killed", "", j.now, 1e9)
    out = j.flush() + j.tick()
    spare = j.c.ranks[2].worker_id
    for rank in range(6):
        m = j.c.ranks[rank]
        j.c.on_message(m.worker_id, Stopped(for_generation=1, committed_step=4, valid=rank != 2), j.now, 1e9)
    out = j.flush() + j.tick()
    recovers = [c.message for c in out if isinstance(c, Send) and isinstance(c.message, Recover)]
    assert recovers and all(r.moved_ranks == [2] and r.table_base == 1 for r in recovers)
    assert all(len(json.dumps(encode(r))) < 1024 for r in recovers)
    truth[2] = f"127.0.0.1:{30000 + spare}"
    res = j.deliver(out, drop={1})  # worker 1 misses this round's messages (as after a failover)
    assert all(r is not None and r["rendezvous"]["peers"] == truth for r in res.values())
    for rank in range(6):
        j.c.on_message(j.c.ranks[rank].worker_id, Recovered(generation=1), j.now, 1e9)
    j.flush()
    # the next round: worker 1 holds version 1, the delta is for version 2 -> it must ask
    j.c.on_exit(4, -9, False, "killed", "", j.now, 1e9)
    j.flush(), j.tick()
    for rank in range(6):
        m = j.c.ranks[rank]
        j.c.on_message(m.worker_id, Stopped(for_generation=2, committed_step=6, valid=rank != 4), j.now, 1e9)
    out = j.flush() + j.tick()
    truth[4] = j.c.ranks[4].store_address
    # the coordinator believes worker 1 holds version 2, so it sent it only the delta 2 -> 3
    assert not any(isinstance(c, Send) and c.worker_id == 1 and isinstance(c.message, PeerTable) for c in out)
    # its host's agent holds version 3 (sent for the new spare): a worker with that copy takes it
    # there; one without (no table directory) must not resolve the plan and asks instead
    base = {w: (h.version, list(h.peers)) for w, h in j.workers.items()}
    with_copy = j.deliver(out)
    assert with_copy[1] is not None and with_copy[1]["rendezvous"]["peers"] == truth
    for w, (version, peers) in base.items():
        j.workers[w].adopt(version, peers)
    res = j.deliver(out, host_copy=False)
    assert j.workers[1].version == 1 and res[1] is None, (
        "a worker that missed a delta must not resolve the plan"
    )
    j.c.on_message(1, PeerTableRequest(have=j.workers[1].version), j.now, 1e9)
    j.deliver(j.flush())
    recover = next(c.message for c in out if isinstance(c, Send) and isinstance(c.message, Recover))
    again = j.workers[1].resolve(encode(recover))
    assert again is not None and again["rendezvous"]["peers"] == truth
    assert all(r is None or r["rendezvous"]["peers"] == truth for r in res.values())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=16,
)
table_fields = st.sampled_from(["version", "digest", "world_size", "first", "hosts", "runs", "junk"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(table_fields, json_values, max_size=7), st.integers(1, 50))
def test_a_malformed_chunk_is_a_protocol_or_table_error_never_a_crash(body: dict[str, Any], n: int) -> None:
    """What the worker's reader thread catches (recovery/link.py, link_table.py): ProtocolError or
    TableError."""
    from checkpointless.protocol import ProtocolError, decode

    holder = holder_with([f"10.0.0.1:{i}" for i in range(n)], 1)
    try:
        m = decode({**body, "type": "peer_table"})
        assert isinstance(m, PeerTable)
        holder.on_chunk(m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs))
    except (ProtocolError, ValueError):
        pass
    assert holder.version == 1 or holder.version == body.get("version"), "only an intact table replaces it"


def test_the_keeper_sends_a_delta_only_to_who_holds_its_base() -> None:
    from checkpointless.peer_table import DELTA_LIMIT, TableKeeper

    t = TableKeeper()
    first = host_major(4, 8, 29600)
    t.update(first)
    assert (t.version, t.base, t.moved) == (1, -1, []), "a first table has nothing to be a delta of"
    assert t.needs_full(0)
    t.sent(0)
    assert not t.needs_full(0)
    second = list(first)
    second[5] = "10.9.9.9:1"
    t.update(second)
    assert (t.version, t.base, t.moved) == (2, 1, [(5, "10.9.9.9:1")])
    assert not t.needs_full(0) and t.needs_full(1), "holder of v1 takes the delta; a newcomer the table"
    t.update(second)  # a round that moved nobody: same version, nothing to apply
    assert (t.version, t.base, t.moved) == (2, 2, [])
    t.forget(0)
    assert t.needs_full(0)
    many = [f"10.8.0.1:{i}" for i in range(DELTA_LIMIT + 1)]
    t.update(many)  # another size: no delta
    t.update([a + "0" for a in many])  # too many changes for a delta
    assert t.base == -1 and t.moved == [] and t.version == 4
    assert assemble(t.chunks(), len(many)) == t.peers and t.digest == table_digest(t.peers)


def test_a_sharded_first_plan_is_one_source_run_at_any_size() -> None:
    shards, ranks = 8, 80_000
    pairs = [[r, r % shards] for r in range(shards, ranks)]
    plan = {"target_step": 0, "source": 0, "receivers": [p[0] for p in pairs], "sources": pairs}
    wire = compact_plan(plan)
    assert len(json.dumps(wire)) < 200, wire
    assert expand_plan(wire) == plan


def test_a_worker_link_that_missed_a_delta_asks_for_the_whole_table_before_it_sees_the_plan(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """The worker's side over a real control connection (recovery/link_table.py): a Recover whose
    delta does not apply is held back, the link asks for the table, and the plan reaches the
    inbox only with the table the digest names; a later delta then applies in place."""
    import time

    from checkpointless.config import WorkerEnv
    from checkpointless.launcher.control import ControlServer
    from checkpointless.protocol import Heartbeat
    from checkpointless.protocol.beats import BEAT_ENV
    from checkpointless.recovery.link import LauncherLink

    monkeypatch.delenv(BEAT_ENV, raising=False)
    secret = b"ab" * 32
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()
    env = WorkerEnv(server.address, secret, 5, "worker", tmp_path, "job", 0, "127.0.0.1")
    link = LauncherLink(env, lambda m: None, Heartbeat, heartbeat_s=60.0)
    try:
        conn, hello = server.inbox.get(timeout=10)
        assert hello["type"] == "hello"
        peers = host_major(3, 4, 29600)
        plan = ResumePlan(4, 0, receivers=list(range(1, 12)))

        def recover(gen: int, table: list[str], version: int, moved: list[int]) -> dict[str, Any]:
            return encode(
                Recover(
                    generation=gen,
                    rendezvous={"kind": "rootless", "timeout": 60},
                    plan=plan,
                    table_version=version,
                    table_base=version - 1,
                    table_digest=table_digest(table),
                    moved_ranks=moved,
                    moved_to=[table[r] for r in moved],
                )
            )

        conn.send(recover(2, peers, 5, [3]))
        _, ask = server.inbox.get(timeout=10)
        assert ask["type"] == "peer_table_request" and ask["have"] == -1
        assert link.inbox.empty(), "no plan before its table"
        for c in encode_chunks(peers, budget=120):
            conn.send(encode(PeerTable(5, table_digest(peers), len(peers), c.first, c.hosts, c.runs)))
        got = link.wait_for((Recover,), time.monotonic() + 10)
        assert got.rendezvous["peers"] == peers and got.plan.receivers == list(range(1, 12))
        moved = list(peers)
        moved[7] = "10.7.7.7:1"
        conn.send(recover(3, moved, 6, [7]))
        got = link.wait_for((Recover,), time.monotonic() + 10)
        assert got.generation == 3 and got.rendezvous["peers"] == moved
        assert server.inbox.empty(), "a delta that applies needs no request"
    finally:
        link.close()
        server.stop()


# -- the host's copy (agent/tables.py) -------------------------------------------------------------
def _table_msgs(peers: list[str], version: int, budget: int = CHUNK_BYTES) -> list[PeerTable]:
    d = table_digest(peers)
    return [PeerTable(version, d, len(peers), c.first, c.hosts, c.runs) for c in encode_chunks(peers, budget)]


def test_a_hosts_copy_is_written_whole_checked_and_read_back_only_for_its_version(tmp_path: Path) -> None:
    peers = [f"10.0.{h // 250}.{h % 250}:{29500 + r}" for h in range(300) for r in range(8)]
    msgs = _table_msgs(peers, 4, budget=2048)
    assert len(msgs) > 3, "several chunks"
    files = TableFiles(tmp_path / "peers")
    written = [files.on_chunk(m) for m in msgs]
    assert written == [None] * (len(msgs) - 1) + [4], "written once, when the last chunk arrived"
    assert [p.name for p in (tmp_path / "peers").iterdir()] == ["v4"], "no temporary file left"
    assert (tmp_path / "peers" / "v4").stat().st_mode & 0o777 == 0o600
    d = msgs[0].digest
    assert read_table(tmp_path / "peers", 4, d) == peers
    assert read_table(tmp_path / "peers", 4, "0" * 24) is None, "a plan with another digest"
    assert read_table(tmp_path / "peers", 5, d) is None, "no copy of that version"


def test_a_broken_table_is_never_written_and_a_bad_file_is_never_read(tmp_path: Path) -> None:
    peers = [f"10.0.0.{h}:{29500 + r}" for h in range(200) for r in range(4)]
    msgs = _table_msgs(peers, 2, budget=1024)
    files = TableFiles(tmp_path / "peers")
    assert all(files.on_chunk(m) is None for m in msgs[:1] + msgs[2:]), "a chunk missing"
    forged = [dataclasses.replace(m, digest="f" * 24) for m in msgs]
    assert all(files.on_chunk(m) is None for m in forged), "chunks that do not match their digest"
    assert not list((tmp_path / "peers").iterdir())
    d = msgs[0].digest
    path = tmp_path / "peers" / "v2"
    for body in (
        b"{not json",
        b'{"version": 2}',
        json.dumps({"version": 2, "digest": d, "chunks": 7}).encode(),
    ):
        path.write_bytes(body)
        assert read_table(tmp_path / "peers", 2, d) is None
    path.unlink()
    real = tmp_path / "elsewhere"
    real.write_bytes(b"{}")
    path.symlink_to(real)
    assert read_table(tmp_path / "peers", 2, d) is None, "a link is not followed"


def test_a_host_keeps_the_two_tables_written_last(tmp_path: Path) -> None:
    files = TableFiles(tmp_path / "peers")
    peers = [f"10.0.0.1:{29500 + r}" for r in range(4)]
    for v in (1, 2, 3):
        peers[v] = f"10.0.0.9:{29600 + v}"
        for m in _table_msgs(peers, v):
            files.on_chunk(m)
    assert sorted(p.name for p in (tmp_path / "peers").iterdir()) == ["v2", "v3"]
    # a coordinator elected after a failover numbers its tables from 1 again
    peers[0] = "10.0.0.8:29700"
    for m in _table_msgs(peers, 1):
        files.on_chunk(m)
    assert sorted(p.name for p in (tmp_path / "peers").iterdir()) == ["v1", "v3"]
    assert read_table(tmp_path / "peers", 1, table_digest(peers)) == peers


def test_a_table_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match="not a private directory"):
        TableFiles(open_dir)
