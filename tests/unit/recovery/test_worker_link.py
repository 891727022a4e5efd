"""A worker's link (recovery/link.py) decodes what the coordinator sends once, on its reader
thread: over a real control connection, frames that are not our messages are dropped with a
warning naming what is wrong, and the link keeps working (the reader thread stays alive, so a
later abort or plan still arrives, typed)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from checkpointless.config import WorkerEnv
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.protocol import (
    SUCCESSION_ENV,
    Abort,
    Assign,
    FiredSeen,
    Heartbeat,
    Prepare,
    Recover,
    ResumePlan,
    encode,
)
from checkpointless.protocol.beats import BEAT_ENV
from checkpointless.recovery.link import LauncherLink

# each would once have reached a dict lookup deep in the worker (a KeyError in the main thread,
# or a ValueError that ended the reader thread); the last field names what the warning says
BAD_FRAMES: list[tuple[dict[str, Any], str]] = [
    ({"type": "no_such_message"}, "unknown message type 'no_such_message'"),
    ({"type": "assign", "world_size": 2, "generation": 0}, "missing field 'rank'"),
    ({"type": "abort", "generation": "soon"}, "abort.generation"),
    ({"type": "shutdown", "code": "now"}, "shutdown.code"),  # valid, it would end this process
    ({"type": "recover", "generation": 1, "rendezvous": {}}, "missing field 'plan'"),
    ({"type": "peer_table", "version": 1}, "missing field 'digest'"),
    ({"type": "succession", "term": 9, "members": "all", "successors": [], "addresses": []}, "members"),
    ({**encode(Prepare(state_bytes=1)), "v": 99}, "protocol version 99"),
]


@pytest.mark.timeout(60)
def test_malformed_control_messages_are_dropped_and_the_link_keeps_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(BEAT_ENV, raising=False)
    monkeypatch.delenv(SUCCESSION_ENV, raising=False)
    secret = b"5a" * 32
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()
    aborts: list[Abort] = []
    env = WorkerEnv(server.address, secret, 4, "spare", tmp_path, "job", 0, "127.0.0.1")
    link = LauncherLink(env, aborts.append, Heartbeat, heartbeat_s=60.0)
    try:
        conn, hello = server.inbox.get(timeout=10)
        assert hello["type"] == "hello" and hello["worker_id"] == 4
        with caplog.at_level(logging.WARNING, logger="checkpointless"):
            for frame, _ in BAD_FRAMES:
                assert conn.send(frame), "the link must not hang up on a bad frame"
            # then good ones: they arrive, in order and typed, so the reader thread survived
            conn.send(encode(Abort(generation=3, reason="a fault")))
            conn.send(encode(Prepare(state_bytes=123)))
            conn.send(encode(Assign(rank=1, world_size=2, generation=3)))
            conn.send(encode(Recover(generation=4, rendezvous={"kind": "tcp"}, plan=ResumePlan(7))))
            assign = link.wait_for((Assign,), time.monotonic() + 10)  # drops the Prepare
            assert (assign.rank, assign.world_size, assign.generation) == (1, 2, 3)
            plan = link.wait_for((Recover, Abort), time.monotonic() + 10)
            assert isinstance(plan, Recover) and plan.plan.target_step == 7
        assert aborts == [Abort(generation=3, reason="a fault")], "abort acts on the reader thread"
        assert link.inbox.empty(), "nothing malformed was queued for the main thread"
        dropped = [r.getMessage() for r in caplog.records if "dropped a control message" in r.getMessage()]
        assert len(dropped) == len(BAD_FRAMES), dropped
        for (_, why), text in zip(BAD_FRAMES, dropped, strict=True):
            assert why in text, (why, text)
        assert link.failover.term == 0, "a malformed succession must not move the term"
    finally:
        link.close()
        server.stop()


@pytest.mark.timeout(30)
def test_waiting_names_the_kinds_it_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BEAT_ENV, raising=False)
    monkeypatch.delenv(SUCCESSION_ENV, raising=False)
    secret = b"6b" * 32
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()
    env = WorkerEnv(server.address, secret, 2, "worker", tmp_path, "job", 0, "127.0.0.1")
    link = LauncherLink(env, lambda m: None, Heartbeat, heartbeat_s=60.0)
    try:
        with pytest.raises(TimeoutError, match="no abort/recover message"):
            link.wait_for((Recover, Abort), time.monotonic() + 0.2)
    finally:
        link.close()
        server.stop()


_FORKING_WORKER = """
import os, sys, time
from checkpointless.protocol.control_client import ControlClient
client = ControlClient(("127.0.0.1", int(sys.argv[1])), bytes.fromhex(sys.argv[2]), lambda m: None, lambda w: None)
client.send({"type": "hello", "worker_id": 0})
child = os.fork()
if child == 0:  # a DataLoader worker, say: it outlives its parent for a while
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
client.send({"type": "done", "step": 3})
os._exit(0)
"""


@pytest.mark.timeout(60)
def test_a_worker_connection_ends_with_the_worker_even_while_a_forked_child_lives() -> None:
    # The launcher judges a worker's exit once its connection has ended (its last frames read);
    # a forked child holding the socket open would delay that until the child died.
    secret = b"5a" * 32
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_WORKER, str(server.address[1]), secret.hex()], stdout=subprocess.PIPE
    )
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0
        got = [server.inbox.get(timeout=10)[1]["type"] for _ in range(3)]
        assert got == ["hello", "done", "_closed"], got
        os.kill(child, 0)  # the child is still alive: the connection ended with its parent
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        server.stop()


@pytest.mark.timeout(30)
def test_a_failed_send_hangs_up_and_leaves_the_close_to_the_server() -> None:
    # The decision loop and the heartbeat thread send on connections that the server's selector
    # thread owns. A send to a worker that is gone must only shut the socket down: closed there,
    # the descriptor would be freed while still registered, its end never reported (`_closed`),
    # and the next socket accepted under the same number would fail to register.
    ours, theirs = socket.socketpair()
    conn = Connection(ours, b"5a" * 32)
    conn.authenticated = True
    theirs.close()
    deadline = time.monotonic() + 10
    while conn.send({"type": "abort", "generation": 1, "reason": "x"}):
        assert time.monotonic() < deadline, "sends to a closed peer kept succeeding"
    assert conn.closed and not conn.send({"type": "abort", "generation": 2, "reason": "x"})
    assert ours.fileno() != -1, "the send closed the descriptor the server's selector still holds"
    ours.setblocking(False)
    assert ours.recv(16) == b"", "the socket was not shut down, so the server never sees its end"
    ours.close()


@pytest.mark.timeout(60)
def test_a_fault_that_ends_its_process_waits_for_the_coordinator_to_record_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``await_fired_seen`` returns once the coordinator's ``FiredSeen`` for that fault arrives
    (another fault's does not count), and gives up at its timeout when none comes."""
    monkeypatch.delenv(BEAT_ENV, raising=False)
    monkeypatch.delenv(SUCCESSION_ENV, raising=False)
    secret = b"5b" * 32
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()
    env = WorkerEnv(server.address, secret, 2, "worker", tmp_path, "job", 0, "127.0.0.1")
    link = LauncherLink(env, lambda _: None, Heartbeat, heartbeat_s=60.0)
    try:
        conn, _ = server.inbox.get(timeout=10)
        start = time.monotonic()
        assert not link.await_fired_seen("kill:rank=1:step=3", 0.3), "nothing recorded it yet"
        assert 0.25 < time.monotonic() - start < 5
        conn.send(encode(FiredSeen(id="raise:rank=0:step=2")))
        assert not link.await_fired_seen("kill:rank=1:step=3", 0.3), "another fault's"
        conn.send(encode(FiredSeen(id="kill:rank=1:step=3")))
        assert link.await_fired_seen("kill:rank=1:step=3", 10)
    finally:
        link.close()
        server.stop()
