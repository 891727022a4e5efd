"""Root-less rendezvous: the pure parts, and store semantics over real sockets in one process.

Key servers here are real (their own threads and loopback sockets); only the multi-process
behaviour (gloo, SIGKILL) lives in test_rendezvous.py.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from checkpointless.errors import ConfigError, RendezvousError
from checkpointless.rendezvous import (
    KeyServer,
    PeerTable,
    RootlessStore,
    allocate_ports,
    group_by_owner,
    key_owner,
    open_listener,
    parse_address,
    port_range_from_env,
    store_barrier,
)
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C
from checkpointless.wire import derive_key, recv_frame, send_frame

SECRET = b"unit-test-secret"
_REQUEST_KEY = derive_key(SECRET, KEYSERVER_C2S)
_REPLY_KEY = derive_key(SECRET, KEYSERVER_S2C)
SHORT = datetime.timedelta(seconds=5)


class Cluster:
    """``n`` key servers on ephemeral loopback ports and one store per rank."""

    def __init__(
        self, n: int, prefix: str = "gen1/", timeout: datetime.timedelta = SHORT, grace: float = 3.0
    ) -> None:
        self.grace = datetime.timedelta(seconds=grace)
        self.servers = [KeyServer("127.0.0.1", 0, SECRET) for _ in range(n)]
        for s in self.servers:
            s.start()
        self.table = PeerTable([s.address for s in self.servers])
        self.stores = [self.store(r, prefix, timeout) for r in range(n)]

    def store(self, rank: int, prefix: str, timeout: datetime.timedelta = SHORT) -> RootlessStore:
        return RootlessStore(
            rank,
            len(self.servers),
            self.table,
            SECRET,
            prefix,
            timeout,
            self.servers[rank],
            connect_grace=self.grace,
        )

    def stop(self) -> None:
        for st in self.stores:
            st.close()
        for s in self.servers:
            s.stop()


@pytest.fixture
def cluster4() -> Iterator[Cluster]:
    c = Cluster(4)
    yield c
    c.stop()


# -- ownership and batching (pure) ------------------------------------------------------------
@pytest.mark.timeout(10)
def test_keys_naming_a_rank_are_owned_by_it() -> None:
    assert key_owner("gen4/0/3", 8) == 3  # gloo's address key of rank 3
    assert key_owner("gen4/default_pg/0/7", 8) == 7
    assert key_owner("gen4/barrier/2/rank_5", 8) == 5
    assert key_owner("0", 1) == 0
    # Not a rank: out of range, signed, zero-padded or not a number -> spread by hashing.
    for key in ("gen4/0/8", "gen4/0/-1", "gen4/0/03", "gen4/0/+3", "gen4/nccl_id", "gen4/0/"):
        assert 0 <= key_owner(key, 8) < 8


@pytest.mark.timeout(30)
def test_hashed_ownership_is_stable_across_processes_and_spread_evenly() -> None:
    keys = [f"gen2/counter_{i}" for i in range(4000)]
    here = [key_owner(k, 16) for k in keys]
    # Another interpreter with another hash seed must compute the same owners.
    code = (
        "import json,sys; from checkpointless.rendezvous.peers import key_owner; "
        "print(json.dumps([key_owner(f'gen2/counter_{i}', 16) for i in range(4000)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=25, check=True
    )
    assert json.loads(out.stdout) == here
    counts = [here.count(r) for r in range(16)]
    assert min(counts) > 0.75 * 250 and max(counts) < 1.25 * 250, counts


@pytest.mark.timeout(10)
def test_group_by_owner_keeps_positions_and_duplicates() -> None:
    keys = ["g/0/1", "g/0/0", "g/0/1", "g/x", "g/0/2"]
    groups = group_by_owner(keys, 3)
    hashed = key_owner("g/x", 3)
    expected = {0: [1], 1: [0, 2], 2: [4]}
    expected[hashed] = sorted([*expected[hashed], 3])
    assert groups == expected


@pytest.mark.timeout(10)
def test_peer_table_round_trip_replace_and_errors() -> None:
    t = PeerTable(["127.0.0.1:31001", "10.0.0.2:31002", "[::1]:31003"])
    assert PeerTable.from_json(t.to_json()) == t
    assert t.endpoint(2) == ("::1", 31003)
    t2 = t.replace(1, "10.0.0.9:31500")
    assert t2[1] == "10.0.0.9:31500" and t2[0] == t[0] and t[1] == "10.0.0.2:31002"
    with pytest.raises(ConfigError, match="same address"):
        PeerTable(["127.0.0.1:31001", "127.0.0.1:31001"])
    for bad in ("localhost", "host:port", "::1:80", "h:70000", ""):
        with pytest.raises(ConfigError):
            parse_address(bad)
    with pytest.raises(ConfigError, match="peers"):
        PeerTable.from_json('{"ranks": []}')


# -- ports ------------------------------------------------------------------------------------
def _free_block(size: int) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on a port ``p`` and sockets bound on ``p+1 .. p+size-1``: a block all ours."""
    for _ in range(200):
        first = open_listener("127.0.0.1", 0)
        base = first.getsockname()[1]
        held: list[socket.socket] = []
        if base + size <= 65535:
            for port in range(base + 1, base + size):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    s.close()
                    break
                held.append(s)
        if len(held) == size - 1:
            return first, held
        for s in held:
            s.close()
        first.close()
    pytest.skip(f"found no {size} consecutive free ports on 127.0.0.1")


@pytest.mark.timeout(20)
def test_allocate_ports_skips_busy_ones_and_names_the_setting_when_full() -> None:
    # The ports next to an ephemeral one may be taken by any other process on the machine (CI
    # ran this beside hundreds of sockets), so the test looks for a block of four it can bind,
    # keeps the first one busy and frees the other three only just before asking.
    busy, spare = _free_block(4)
    try:
        base = busy.getsockname()[1]
        for s in spare:
            s.close()
        got = allocate_ports(base, 2, "127.0.0.1", span=4)
        assert base not in got and len(got) == 2
        with pytest.raises(ConfigError) as e:
            allocate_ports(base, 1, "127.0.0.1", span=1)
        msg = str(e.value)
        assert f"busy: {base}" in msg and "--port-base" in msg and "CHECKPOINTLESS_PORT_BASE" in msg
    finally:
        busy.close()
    with pytest.raises(ConfigError, match="--port-range"):
        allocate_ports(31000, 5, span=3)


@pytest.mark.timeout(10)
def test_port_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHECKPOINTLESS_PORT_BASE", raising=False)
    monkeypatch.setenv("CHECKPOINTLESS_PORT_RANGE", "200")
    assert port_range_from_env(29600, 1000) == (29600, 200)
    monkeypatch.setenv("CHECKPOINTLESS_PORT_BASE", "thirty")
    with pytest.raises(ConfigError, match="CHECKPOINTLESS_PORT_BASE"):
        port_range_from_env(29600, 1000)


@pytest.mark.timeout(10)
def test_key_server_on_a_port_in_use_names_the_port_and_the_setting() -> None:
    first = KeyServer("127.0.0.1", 0, SECRET)
    try:
        with pytest.raises(ConfigError) as e:
            KeyServer("127.0.0.1", first.port, SECRET)
        assert f"port {first.port}" in str(e.value) and "CHECKPOINTLESS_PORT_BASE" in str(e.value)
    finally:
        first.stop()


# -- store semantics --------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_store_matches_torch_hashstore_semantics(cluster4: Cluster) -> None:
    """The same operations give the same answers as torch's own in-memory store."""
    ref = dist.HashStore()
    ref.set_timeout(SHORT)
    mine = cluster4.stores[1]
    keys = ["a", "0/1", "0/2", "count", "x/y"]  # owned by rank 1 (local) and by others (remote)
    assert {mine.owner(k) for k in keys} - {1}
    for s in (ref, mine):
        s.set("a", "1")
        s.set("0/1", b"\x00\xffbin")
        s.multi_set(["0/2", "x/y"], ["two", b"why"])
    for s in (ref, mine):
        s.set("a", "again")  # overwrite
    results = []
    for s in (ref, mine):
        r = [
            s.get("a"),
            s.get("0/1"),
            s.multi_get(["x/y", "0/2", "a", "0/2"]),
            s.add("count", 5),
            s.add("count", -2),
            s.get("count"),
            s.compare_set("a", "again", "swapped"),
            s.compare_set("a", "nope", "other"),
            s.compare_set("missing", "", "created"),
            s.compare_set("missing2", "expected", "never"),
            s.check(["missing2"]),
            s.check(["a", "0/2", "x/y"]),
            s.check(["a", "nothing"]),
        ]
        s.append("log", b"ab")
        s.append("log", "cd")
        r += [s.get("log"), s.delete_key("log"), s.delete_key("log"), s.check(["log"]), s.num_keys()]
        results.append(r)
    assert results[0] == results[1]


@pytest.mark.timeout(30)
def test_wait_get_and_add_work_across_ranks_and_threads(cluster4: Cluster) -> None:
    st = cluster4.stores
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(st[0].get("late/3")))  # owned by rank 3
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive() and not got
    st[3].set("late/3", "here")
    reader.join(5)
    assert got == [b"here"]
    st[2].wait(["late/3"], datetime.timedelta(seconds=1))
    # Concurrent adds from every rank and several threads each: no increment may be lost.
    threads = [threading.Thread(target=lambda s=s: [s.add("ctr", 1) for _ in range(25)]) for s in st * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert int(st[0].get("ctr")) == 200


@pytest.mark.timeout(20)
def test_batched_reads_send_one_request_per_owner(cluster4: Cluster) -> None:
    st = cluster4.stores
    for r in range(4):
        st[r].set(f"0/{r}", f"addr{r}")  # gloo's keys: every rank writes its own, locally
    assert all(s.stats.requests == 0 for s in cluster4.servers)
    before = st[0].requests_sent
    values = st[0].multi_get([f"0/{r}" for r in range(4)] * 3)
    assert values == [f"addr{r}".encode() for r in range(4)] * 3
    assert st[0].requests_sent - before == 3  # ranks 1, 2, 3; its own key is read in-process
    assert [s.stats.requests for s in cluster4.servers] == [0, 1, 1, 1]


@pytest.mark.timeout(20)
def test_generations_have_separate_key_spaces(cluster4: Cluster) -> None:
    old, new = cluster4.stores[0], cluster4.store(0, "gen2/")
    old.set("0/1", "stale")
    assert not new.check(["0/1"])
    with pytest.raises(RendezvousError, match="never written"):
        new.wait(["0/1"], datetime.timedelta(seconds=0.3))
    assert cluster4.servers[1].drop_prefix("gen1/") == 1
    assert not old.check(["0/1"])


@pytest.mark.timeout(20)
def test_a_key_never_written_times_out_with_its_name(cluster4: Cluster) -> None:
    st = cluster4.store(0, "gen1/", datetime.timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 2 .*gen1/0/2.*never written"):
        st.get("0/2")
    assert time.monotonic() - t0 < 3


# -- security ---------------------------------------------------------------------------------
@pytest.mark.timeout(20)
def test_wrong_secret_is_rejected_by_both_sides(cluster4: Cluster) -> None:
    intruder = RootlessStore(0, 4, cluster4.table, b"not-the-secret", "gen1/", SHORT)
    with pytest.raises(RendezvousError, match="authentication"):
        intruder.get("0/1")
    with pytest.raises(RendezvousError, match="authentication"):
        intruder.set("0/2", "forged")
    # A raw frame sealed with another secret is refused unread, and the server hangs up without
    # a word: no sealed answer that a forger could collect.
    with socket.create_connection(cluster4.table.endpoint(2), timeout=5) as sock:
        send_frame(sock, b"not-the-secret", {"op": "set", "keys": ["gen1/0/2"], "lens": [1], "seq": 1}, b"x")
        assert sock.recv(1) == b""
    assert cluster4.servers[2].stats.rejected >= 1
    assert not cluster4.stores[3].check(["0/2"])
    cluster4.stores[3].set("0/2", "fine")  # the server still serves the job
    assert cluster4.stores[0].get("0/2") == b"fine"


@pytest.mark.timeout(20)
def test_replayed_or_unkeyed_writes_are_rejected(cluster4: Cluster) -> None:
    def request(sock: socket.socket, header: dict[str, object]) -> dict[str, object]:
        send_frame(sock, _REQUEST_KEY, header)
        return recv_frame(sock, _REPLY_KEY, time.monotonic() + 5)[0]

    def add(nonce: object, seq: int) -> dict[str, object]:
        return {"op": "add", "keys": ["gen1/c"], "amount": 1, "nonce": nonce, "seq": seq}

    with socket.create_connection(cluster4.table.endpoint(1), timeout=5) as sock:
        nonce = request(sock, {"op": "hello", "seq": 1})["nonce"]
        assert request(sock, add(nonce, 2))["value"] == 1
        send_frame(sock, _REQUEST_KEY, add(nonce, 2))  # the same frame again
        assert sock.recv(1) == b""
    with socket.create_connection(cluster4.table.endpoint(1), timeout=5) as sock:
        send_frame(sock, _REQUEST_KEY, add(nonce, 1))  # another connection's nonce: a replay
        assert sock.recv(1) == b""
    with socket.create_connection(cluster4.table.endpoint(1), timeout=5) as sock:
        assert (
            request(sock, {"op": "check", "keys": ["gen1/c"], "seq": 1})["present"] is True
        )  # reads need none
        send_frame(sock, _REQUEST_KEY, add(None, 2))  # a write without a nonce
        assert sock.recv(1) == b""
    assert cluster4.servers[1].stats.rejected == 3
    assert cluster4.stores[1].get("c") == b"1"


# -- failures and start-up --------------------------------------------------------------------
@pytest.mark.timeout(20)
def test_a_stopped_owner_fails_fast_with_its_rank(cluster4: Cluster) -> None:
    st = cluster4.store(0, "gen1/", datetime.timedelta(seconds=30))
    waiting: list[BaseException] = []

    def read() -> None:
        try:
            st.multi_get(["0/1", "0/2", "0/3"])
        except RendezvousError as e:
            waiting.append(e)

    cluster4.stores[1].set("0/1", "a")
    th = threading.Thread(target=read)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    cluster4.servers[2].stop()
    th.join(5)
    assert time.monotonic() - t0 < 2
    assert waiting and f"rank 2 ({cluster4.table[2]})" in str(waiting[0])
    cluster4.grace = datetime.timedelta(seconds=0.2)
    fresh = cluster4.store(0, "gen1/", datetime.timedelta(seconds=30))
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 2 .*refused"):
        fresh.get("0/2")
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(20)
def test_a_late_owner_is_waited_for_when_the_launcher_bound_its_port() -> None:
    """A listener bound ahead of time queues requests until its process starts serving."""
    sock = open_listener("127.0.0.1", 0)
    early = KeyServer("127.0.0.1", 0, SECRET)
    early.start()
    table = PeerTable([early.address, f"127.0.0.1:{sock.getsockname()[1]}"])
    reader = RootlessStore(0, 2, table, SECRET, "g/", SHORT, early, connect_grace=datetime.timedelta(0))
    got: list[bytes] = []
    th = threading.Thread(target=lambda: got.append(reader.get("0/1")))
    th.start()
    time.sleep(0.5)  # the reader is connected but unanswered: not "refused", not an error
    late = KeyServer("127.0.0.1", 0, SECRET, listen_fd=sock.detach())
    late.start()
    RootlessStore(1, 2, table, SECRET, "g/", SHORT, late).set("0/1", "late")
    th.join(5)
    assert got == [b"late"]
    early.stop()
    late.stop()


# -- barriers ---------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ["counter", "dissemination"])
def test_barrier_waits_for_every_rank(algorithm: str) -> None:
    c = Cluster(5)
    try:
        passed: list[float] = []
        errors: list[BaseException] = []

        def arrive(rank: int, delay: float) -> None:
            time.sleep(delay)
            try:
                store_barrier(c.stores[rank], "b1", 5, SHORT, algorithm=algorithm)
                passed.append(time.monotonic())
            except RendezvousError as e:
                errors.append(e)

        t0 = time.monotonic()
        threads = [threading.Thread(target=arrive, args=(r, 0.4 if r == 3 else 0.0)) for r in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors and len(passed) == 5
        assert min(passed) - t0 >= 0.4  # nobody left before the late rank arrived
    finally:
        c.stop()


@pytest.mark.timeout(30)
def test_dissemination_barrier_names_a_dead_rank_everywhere_fast() -> None:
    c = Cluster(6, grace=0.1)
    try:
        errors: dict[int, str] = {}

        def arrive(rank: int) -> None:
            try:
                store_barrier(c.stores[rank], "b2", 6, datetime.timedelta(seconds=20))
            except RendezvousError as e:
                errors[rank] = str(e)

        threads = [threading.Thread(target=arrive, args=(r,)) for r in range(6) if r != 4]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        c.servers[4].stop()  # rank 4 never arrives, and its server goes away
        for t in threads:
            t.join(10)
        assert time.monotonic() - t0 < 3
        assert sorted(errors) == [0, 1, 2, 3, 5]
        assert all("rank 4 (" in msg for msg in errors.values()), errors
    finally:
        c.stop()


@pytest.mark.timeout(20)
def test_counter_barrier_works_on_torch_stores_too() -> None:
    ref = dist.HashStore()
    ref.set_timeout(SHORT)
    threads = [threading.Thread(target=store_barrier, args=(ref, "b", 3, SHORT)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ref.get("b/count") == b"3" and ref.check(["b/done"])
    with pytest.raises(RendezvousError, match="used before"):
        store_barrier(ref, "b", 3, SHORT)
