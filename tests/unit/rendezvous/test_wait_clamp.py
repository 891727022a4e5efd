"""Waits longer than a deadline can hold: a client's 10000-day timeout (Lightning's barrier
timeout, handed down by torch) must not end the key server's loop thread (issue 38)."""

from __future__ import annotations

import datetime
import math
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C, MAX_WAIT_S, clamp_wait
from checkpointless.wire import derive_key, recv_frame, send_frame

SECRET = b"unit-test-secret"
_REQUEST_KEY = derive_key(SECRET, KEYSERVER_C2S)
_REPLY_KEY = derive_key(SECRET, KEYSERVER_S2C)
TEN_THOUSAND_DAYS = datetime.timedelta(days=10000)


@pytest.fixture
def servers() -> Iterator[list[KeyServer]]:
    out = [KeyServer("127.0.0.1", 0, SECRET) for _ in range(2)]
    for s in out:
        s.start()
    yield out
    for s in out:
        s.stop()


def _store(servers: list[KeyServer], rank: int, timeout: datetime.timedelta) -> RootlessStore:
    table = PeerTable([s.address for s in servers])
    return RootlessStore(rank, len(servers), table, SECRET, "gen0/", timeout, servers[rank])


def _request(sock: socket.socket, header: dict[str, object]) -> dict[str, object]:
    send_frame(sock, _REQUEST_KEY, header)
    return recv_frame(sock, _REPLY_KEY, time.monotonic() + 5)[0]


def _loop_alive(server: KeyServer) -> bool:
    return any(t.name == f"cl-keyserver-{server.port}" for t in threading.enumerate())


def _key_owned_by(store: RootlessStore, rank: int) -> str:
    return next(k for k in (f"k{i}" for i in range(1000)) if store.owner(k) == rank)


@pytest.mark.timeout(20)
def test_clamp_wait_bounds() -> None:
    assert clamp_wait(3.5) == 3.5
    assert clamp_wait(-1.0) == 0.0
    assert clamp_wait(TEN_THOUSAND_DAYS.total_seconds()) == MAX_WAIT_S
    assert clamp_wait(math.inf) == MAX_WAIT_S
    with pytest.raises(ValueError):
        clamp_wait(math.nan)


@pytest.mark.timeout(20)
def test_a_ten_thousand_day_wait_leaves_the_server_serving(servers: list[KeyServer]) -> None:
    """A raw request, as any client may send it, parks with a 10000-day timeout: the server's
    loop goes on serving (before the clamp, its select raised OverflowError and the thread
    ended), and the wait is answered when the key is written."""
    writer = _store(servers, 0, datetime.timedelta(seconds=5))
    key = _key_owned_by(writer, 1)
    with socket.create_connection(("127.0.0.1", servers[1].port), timeout=5) as sock:
        send_frame(
            sock,
            _REQUEST_KEY,
            {"op": "wait", "keys": [f"gen0/{key}"], "timeout": TEN_THOUSAND_DAYS.total_seconds(), "seq": 1},
        )
        time.sleep(0.3)  # the request is parked and the loop has gone round with its deadline
        assert _request(sock, {"op": "ping", "seq": 2})["ok"] is True
        writer.set(key, "here")
        assert recv_frame(sock, _REPLY_KEY, time.monotonic() + 5)[0] == {"seq": 1, "ok": True}
        # not a number: refused as a bad request, and the server still serves
        bad = _request(sock, {"op": "wait", "keys": ["gen0/x"], "timeout": math.nan, "seq": 3})
        assert bad["ok"] is False and bad["error"] == "bad-request"
        assert _request(sock, {"op": "ping", "seq": 4})["ok"] is True
    assert _loop_alive(servers[1])


@pytest.mark.timeout(20)
def test_a_store_with_a_ten_thousand_day_timeout_waits_and_gets(servers: list[KeyServer]) -> None:
    """Torch's path: the store's own timeout is the process group's (10000 days in Lightning)."""
    reader, writer = _store(servers, 0, TEN_THOUSAND_DAYS), _store(servers, 1, TEN_THOUSAND_DAYS)
    key = _key_owned_by(reader, 1)
    got: list[bytes] = []
    th = threading.Thread(target=lambda: got.append(reader.get(key)), daemon=True)
    th.start()
    time.sleep(0.3)
    assert th.is_alive()
    writer.set(key, "value")
    th.join(5)
    assert got == [b"value"]
    local = _key_owned_by(reader, 0)  # a key this process serves itself: a local wait
    waiter = threading.Thread(target=lambda: reader.wait([local], TEN_THOUSAND_DAYS), daemon=True)
    waiter.start()
    time.sleep(0.2)
    writer.set(local, "x")
    waiter.join(5)
    assert not waiter.is_alive()
    assert all(_loop_alive(s) for s in servers)
