"""Which rendezvous keys a gloo rank reads, at start-up and after a rank is replaced.

Full mesh (the default): every rank reads all N keys before its group exists. Lazy
(``CHECKPOINTLESS_GLOO_CONNECT=lazy``, opt-in: comm/handle.py:gloo_connect says why): a rank reads a peer's key only when a collective first needs that
peer, so a ring all-reduce reads its two neighbours' keys and nothing else. The ranks here are
threads of this process, each with its own key server and root-less store (as under the
launcher); a recovery replaces one rank's key server, as a spare process brings its own. The
counts are the simulator's lazy model (simulate/plans.py:lazy_keys_read) held to gloo itself.
"""

from __future__ import annotations

import datetime
import threading
import time
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


def test_lazy_a_dead_peer_fails_the_first_collective_at_once_naming_it(
    launcher_env: pytest.MonkeyPatch,
) -> None:
    """Forming no longer waits for the peers, so a dead one is found by the first collective that
    needs it: as fast as the full mesh finds it while forming, with the store's error naming it."""
    launcher_env.setenv(GLOO_CONNECT_VAR, "lazy")
    ranks = _Ranks(2)
    try:
        ranks.servers[1].stop()  # rank 1 died before it wrote its key
        table = PeerTable([s.address for s in ranks.servers])
        store = RootlessStore(
            0,
            2,
            table,
            SECRET,
            "gen0/",
            TIMEOUT,
            ranks.servers[0],
            connect_grace=datetime.timedelta(seconds=0.5),
        )
        t0 = time.monotonic()
        pg = new_group("gloo", store, 0, 2, TIMEOUT)
        assert time.monotonic() - t0 < 5.0  # formed without waiting for rank 1
        with pytest.raises(RendezvousError, match=r"rank 1 \(127\.0\.0\.1:\d+\) refused connections"):
            pg.allreduce([torch.ones(4)]).wait()
        assert time.monotonic() - t0 < 10.0, "the dead peer must be named long before the 30 s timeout"
        del pg
    finally:
        ranks.close()


def test_an_unknown_mode_is_refused_naming_the_value_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_CONNECT_VAR, "mesh")
    with pytest.raises(RendezvousError, match=r"CHECKPOINTLESS_GLOO_CONNECT='mesh'.*'full'.*'lazy'"):
        gloo_connect()
