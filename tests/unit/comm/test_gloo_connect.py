"""Which rendezvous keys a gloo rank reads, at start-up and after a rank is replaced.

Lazy (the default, ``CHECKPOINTLESS_GLOO_CONNECT=lazy``): a rank reads a peer's key only when
a collective first needs that peer, so a ring all-reduce reads its two neighbours' keys and
nothing else. Full mesh (``full``): every rank reads all N keys before its group exists. The ranks here are
threads of this process, each with its own key server and root-less store (as under the
launcher); a recovery replaces one rank's key server, as a spare process brings its own. The
counts are the simulator's lazy model (simulate/plans.py:lazy_keys_read) held to gloo itself.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from checkpointless.comm.handle import GLOO_CONNECT_VAR, gloo_connect, new_group
from checkpointless.config import ENV
from checkpointless.errors import RendezvousError
from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore
from checkpointless.simulate.plans import lazy_keys_read, lazy_peers

pytestmark = pytest.mark.timeout(120)

SECRET = b"gloo-connect-test"
TIMEOUT = datetime.timedelta(seconds=30)


class _CountingStore(RootlessStore):
    """A root-less store that records every key gloo reads through it (get or multi_get)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: list[str] = []
        self._lock = threading.Lock()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._lock:
            self.read.extend(keys)
        return super().multi_get(keys)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]


class _Ranks:
    """N ranks as threads, each with its own key server (a replaced rank gets a new one)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.servers = [self._server() for _ in range(n)]
        self.retired: list[KeyServer] = []

    @staticmethod
    def _server() -> KeyServer:
        server = KeyServer("127.0.0.1", 0, SECRET)
        server.start()
        return server

    def replace(self, rank: int) -> None:
        self.retired.append(self.servers[rank])
        self.servers[rank] = self._server()

    def generation(self, gen: int, ops: tuple[str, ...] = ("allreduce",)) -> list[set[int]]:
        """Form generation ``gen`` on every rank, run ``ops``; each rank's peers whose key it read."""
        table = PeerTable([s.address for s in self.servers])
        stores = [
            _CountingStore(r, self.n, table, SECRET, f"gen{gen}/", TIMEOUT, self.servers[r])
            for r in range(self.n)
        ]
        sums: list[float] = [0.0] * self.n
        errors: list[BaseException] = []
        groups: list[Any] = []

        def rank_main(r: int) -> None:
            try:
                pg = new_group("gloo", stores[r], r, self.n, TIMEOUT)
                groups.append(pg)
                x = torch.full((64,), float(r + 1))
                if "allreduce" in ops:
                    pg.allreduce([x]).wait()
                if "send" in ops:  # each rank sends to its successor, as a state transfer does
                    nxt, prev = (r + 1) % self.n, (r - 1) % self.n
                    buf = torch.empty(64)
                    recv = pg.recv([buf], prev, 0)
                    pg.send([x], nxt, 0).wait()
                    recv.wait()
                    x = x + buf
                if "broadcast" in ops:
                    pg.broadcast([torch.zeros(4) if r else torch.ones(4)]).wait()
                if "barrier" in ops:
                    pg.barrier().wait()
                sums[r] = float(x[0])
            except BaseException as e:  # reported by the test, with its rank
                errors.append(e)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        if "allreduce" in ops:
            assert sums == [float(self.n * (self.n + 1) // 2)] * self.n, sums
        elif "send" in ops:  # each rank's own value plus its predecessor's
            assert sums == [float(r + 1 + (r - 1) % self.n + 1) for r in range(self.n)], sums
        groups.clear()  # their destructors join gloo's threads, here, before the stores go
        return [{int(k.rpartition("/")[2]) for k in s.read} for s in stores]

    def close(self) -> None:
        for s in self.servers + self.retired:
            s.stop()


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv(ENV.HOST, "127.0.0.1")  # the launcher's path: gloo bound to the job's host
    monkeypatch.setenv("GLOO_ENABLE_STORE_V2_API", "1")
    yield monkeypatch


def _ring(r: int, n: int) -> set[int]:
    return {(r - 1) % n, (r + 1) % n} - {r}


@pytest.mark.parametrize("n", [2, 5, 8])
def test_lazy_reads_only_the_ring_neighbours_at_start_and_after_a_replacement(
    launcher_env: pytest.MonkeyPatch, n: int
) -> None:
    launcher_env.setenv(GLOO_CONNECT_VAR, "lazy")
    ranks = _Ranks(n)
    try:
        first = ranks.generation(0)
        ranks.replace(n - 1)  # a spare takes the last rank's place: a new process, a new server
        second = ranks.generation(1)
        ranks.replace(n - 1)  # and again: the same rank replaced twice
        third = ranks.generation(2)
    finally:
        ranks.close()
    for reads in (first, second, third):
        assert reads == [_ring(r, n) for r in range(n)]
        assert max(len(r) for r in reads) == lazy_keys_read(n, collectives=("allreduce",))


@pytest.mark.parametrize("n", [3])
def test_full_mesh_reads_every_key_on_every_rank(launcher_env: pytest.MonkeyPatch, n: int) -> None:
    launcher_env.setenv(GLOO_CONNECT_VAR, "full")
    ranks = _Ranks(n)
    try:
        first = ranks.generation(0)
        ranks.replace(1)
        second = ranks.generation(1)
    finally:
        ranks.close()
    assert first == second == [set(range(n))] * n


def test_lazy_point_to_point_reads_only_the_partner(launcher_env: pytest.MonkeyPatch) -> None:
    launcher_env.setenv(GLOO_CONNECT_VAR, "lazy")
    ranks = _Ranks(6)
    try:
        reads = ranks.generation(0, ops=("send",))
    finally:
        ranks.close()
    assert reads == [_ring(r, 6) for r in range(6)]


@pytest.mark.parametrize("n", [5, 9])
def test_lazy_barrier_and_broadcast_read_the_models_peers(launcher_env: pytest.MonkeyPatch, n: int) -> None:
    """A barrier (dissemination: ranks 2^k away) and a broadcast (a binomial tree within the
    barrier's partners) add about 2 log2(N) peers to the ring's two, not N."""
    launcher_env.setenv(GLOO_CONNECT_VAR, "lazy")
    ranks = _Ranks(n)
    try:
        reads = ranks.generation(0, ops=("allreduce", "broadcast", "barrier"))
    finally:
        ranks.close()
    assert reads == [lazy_peers(r, n) for r in range(n)]


# Rank 1 died before it wrote its key; rank 0 forms lazily (the default) and its first all-reduce
# reads rank 1's key on gloo's worker thread. Before the store failed such a read with a value
# (rendezvous/foreign_reads.py), the second wait threw the work's Python error again and the
# process ended on SIGABRT, so this runs in a child process.
_DEAD_PEER = """
import datetime, time, torch
from checkpointless.comm.handle import Handle, gloo_connect, new_group
from checkpointless.errors import CommAborted
from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore

assert gloo_connect() == "lazy", gloo_connect()
servers = [KeyServer("127.0.0.1", 0, b"s"), KeyServer("127.0.0.1", 0, b"s")]
for s in servers:
    s.start()
servers[1].stop()
table = PeerTable([s.address for s in servers])
grace = datetime.timedelta(seconds=0.5)
store = RootlessStore(0, 2, table, b"s", "gen0/", datetime.timedelta(seconds=30), servers[0], connect_grace=grace)
t0 = time.monotonic()
pg = new_group("gloo", store, 0, 2, datetime.timedelta(seconds=30))
formed = time.monotonic() - t0
work = pg.allreduce([torch.ones(4)])
handle = Handle(work, None, lambda h: None, poll=True)  # how every gloo collective is waited on
try:
    handle.wait(10.0)  # a bounded wait that raises, then the completed work's outcome: two throws
except CommAborted as e:
    print("handle", e)
for _ in range(2):  # and the same work's error, again
    try:
        work.wait()
    except Exception as e:
        print("raw", type(e).__name__, e)
try:  # gloo gave up on the pair: the next collective that needs it fails at once too
    pg.allreduce([torch.ones(4)]).wait()
except Exception as e:
    print("next", type(e).__name__)
print("formed", round(formed, 2), "failed", round(time.monotonic() - t0, 2))
del pg
servers[0].stop()
"""


def test_lazy_a_dead_peer_fails_the_collective_as_often_as_it_is_waited_on_naming_it() -> None:
    """Forming no longer waits for the peers, so a dead one is found by the first collective
    that needs it, with the store's reason, and the survivor lives on to recover."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env[ENV.HOST] = "127.0.0.1"  # the launcher's path; the connection mode is left at its default
    p = subprocess.run(
        [sys.executable, "-c", _DEAD_PEER], capture_output=True, text=True, timeout=60, env=env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "terminate called" not in p.stderr, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    named = r"store read failed: rank 1 \(127\.0\.0\.1:\d+\) refused connections"
    raw = [line for line in lines if line.startswith("raw ")]
    assert len(raw) == 2 and all(re.match(r"raw TypeError Object of type '" + named, r) for r in raw), lines
    assert any(re.match(r"handle collective failed: .*" + named, line) for line in lines), lines
    assert "next RuntimeError" in lines, lines
    formed, failed = (float(x) for x in lines[-1].split()[1::2])
    assert formed < 5.0  # formed without waiting for rank 1
    assert failed < 10.0, "the dead peer must be named long before the 30 s timeout"


def test_a_read_on_a_python_thread_still_raises_the_stores_error(launcher_env: pytest.MonkeyPatch) -> None:
    """Only a C++ library's own thread gets the refused value; Python callers, through torch's
    C++ store wrappers too, get the RendezvousError as before."""
    ranks = _Ranks(2)
    try:
        ranks.servers[1].stop()
        table = PeerTable([s.address for s in ranks.servers])
        grace = datetime.timedelta(seconds=0.2)
        store = RootlessStore(0, 2, table, SECRET, "gen0/", TIMEOUT, ranks.servers[0], connect_grace=grace)
        for reader in (store, torch.distributed.PrefixStore("p/", store)):
            with pytest.raises(RendezvousError, match=r"rank 1 .* refused connections"):
                reader.get("1")
    finally:
        ranks.close()


def test_an_unknown_mode_is_refused_naming_the_value_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_CONNECT_VAR, "mesh")
    with pytest.raises(
        RendezvousError, match=r"CHECKPOINTLESS_GLOO_CONNECT='mesh'.*'lazy'.*the default.*'full'"
    ):
        gloo_connect()
