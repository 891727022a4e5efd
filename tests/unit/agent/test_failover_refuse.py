"""An agent's failover server while it is not a candidate (agent/failover.py:refuse_all), over a
real control server and real client connections: reconnects for the term of the coordinator the
agent already serves are hung up at once (the worker moves on to the winner within its gather
window); those for a later term are kept, in case this agent stands for it."""

from __future__ import annotations

import threading
import time

import pytest

from checkpointless.agent.failover import Early, refuse_all
from checkpointless.launcher.control import ControlServer
from checkpointless.protocol import Hello, encode
from checkpointless.protocol.control_client import ControlClient

pytestmark = pytest.mark.timeout(30)
SECRET = b"7c" * 32


def _client(server: ControlServer, term: int) -> threading.Event:
    lost = threading.Event()
    client = ControlClient(server.address, SECRET, lambda m: None, lambda why: lost.set(), timeout=5.0)
    client.send(encode(Hello(worker_id=term, pid=1, role="worker", term=term, rank=0)))
    return lost


def _refuse_until(server: ControlServer, early: Early, serving: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(early) < n and time.monotonic() < deadline:
        refuse_all(server, early, keep_s=60.0, serving=serving)
        time.sleep(0.01)


def test_a_reconnect_for_the_served_term_is_hung_up_at_once_a_later_one_kept() -> None:
    server = ControlServer("127.0.0.1", 0, SECRET)
    server.start()
    try:
        early: Early = []
        settled = _client(server, term=1)  # this agent already serves the coordinator of term 1
        later = _client(server, term=2)  # a failover still to come: this agent may stand for it
        _refuse_until(server, early, serving=1, n=1)
        assert settled.wait(5.0), "a reconnect for the served term must be hung up at once"
        assert [e[2]["term"] for e in early] == [2] and not later.is_set()
        # before any failover (serving 0) every reconnect is kept for a lease
        kept: Early = []
        first = _client(server, term=1)
        _refuse_until(server, kept, serving=0, n=1)
        assert [e[2]["term"] for e in kept] == [1] and not first.is_set()
        # ... and hung up once this agent serves that term
        refuse_all(server, kept, keep_s=60.0, serving=1)
        assert not kept and first.wait(5.0)
    finally:
        server.stop()
