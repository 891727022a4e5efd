"""Hostile or bad input on real sockets and real files: each test is one attack that used to work."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from checkpointless.errors import ConfigError
from checkpointless.launcher.control import AUTH_DEADLINE_S, MAX_UNAUTHENTICATED, ControlServer
from checkpointless.launcher.runfiles import make_run_dir, remove_early, write_secret
from checkpointless.protocol.control_channel import OPENING_SIZE, opening
from checkpointless.protocol.control_client import ControlClient
from checkpointless.rendezvous import KeyServer
from checkpointless.rendezvous.client import PeerClient
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C
from checkpointless.rendezvous.peers import PeerTable
from checkpointless.wire import PREFIX_SIZE, derive_key, recv_frame, send_frame
from tests.helpers.paths import SCRIPTS

pytestmark = pytest.mark.timeout(60)

SECRET = b"hostile-input-test-secret"
C2S = derive_key(SECRET, "control/c2s")
S2C = derive_key(SECRET, "control/s2c")


def _greeted(sock: socket.socket) -> dict[str, Any]:
    """A raw client's side of the handshake: its opening (launcher/control.py), then the greeting."""
    sock.sendall(opening()[0])
    return recv_frame(sock, S2C, time.monotonic() + 5)[0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the peer closes (EOF or reset) within ``seconds``; drains what it sends first."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


@pytest.fixture
def control() -> Any:
    server = ControlServer("127.0.0.1", 0, SECRET)
    server.start()
    yield server
    server.stop()


def _worker(server: ControlServer, worker_id: int = 0) -> ControlClient:
    got: list[dict[str, Any]] = []
    client = ControlClient(server.address, SECRET, got.append, lambda why: None)
    client.send({"type": "hello", "worker_id": worker_id})
    return client


def _next(server: ControlServer, timeout: float = 5.0) -> tuple[Any, dict[str, Any]]:
    return server.inbox.get(timeout=timeout)


# -- caps before allocation -----------------------------------------------------------------
@pytest.mark.parametrize("announced", [2 << 30, 1 << 40, (1 << 64) - 1])
def test_an_oversized_prefix_closes_the_control_connection_without_allocating(
    control: ControlServer, announced: int
) -> None:
    before = _rss_bytes()
    with socket.create_connection(control.address, timeout=5) as sock:
        _greeted(sock)  # the greeting
        sock.sendall(struct.pack(">IQ", 10, announced) + b"\0" * 32)
        assert _closed_within(sock, 3)
    assert _rss_bytes() - before < 64 << 20  # nowhere near the announced size
    # the server is unharmed: a real worker still gets through
    client = _worker(control)
    conn, msg = _next(control)
    assert msg["type"] == "hello" and conn.send({"type": "ping"})
    client.close()


def test_an_oversized_header_prefix_is_refused_by_the_blocking_reader_too() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">IQ", 1 << 30, 0) + b"\0" * 32)
        from checkpointless.wire import FrameTooLarge

        with pytest.raises(FrameTooLarge, match="too large"):
            recv_frame(b, b"k", time.monotonic() + 2)


# -- authentication deadline, bounded unauthenticated connections, one thread ------------------
def test_idle_connections_cost_no_threads_and_are_closed_after_the_auth_deadline(
    control: ControlServer,
) -> None:
    threads_before = threading.active_count()
    socks = [socket.create_connection(control.address, timeout=5) for _ in range(300)]
    try:
        time.sleep(0.3)
        assert threading.active_count() <= threads_before + 1, "a thread per connection is back"
        assert control.unauthenticated <= MAX_UNAUTHENTICATED
        t0 = time.monotonic()
        for s in socks:
            assert _closed_within(s, AUTH_DEADLINE_S + 3 - (time.monotonic() - t0))
        assert time.monotonic() - t0 < AUTH_DEADLINE_S + 3
        assert control.unauthenticated == 0
        assert control.inbox.empty()  # unauthenticated peers never reach the decision loop
    finally:
        for s in socks:
            s.close()
    client = _worker(control)
    assert _next(control)[1]["type"] == "hello"
    client.close()


def test_a_worker_connects_through_a_flood_of_idle_connections(control: ControlServer) -> None:
    # A local process holds the server's limit of idle connections (renewing them would keep it
    # there): a worker or spare connecting now must still get through, or every spare would
    # fail at its start. The oldest idle connection makes room, not the newcomer.
    socks = [socket.create_connection(control.address, timeout=5) for _ in range(MAX_UNAUTHENTICATED)]
    try:
        # all accepted (well before the authentication deadline would close them)
        deadline = time.monotonic() + AUTH_DEADLINE_S / 2
        while control.unauthenticated < MAX_UNAUTHENTICATED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert control.unauthenticated == MAX_UNAUTHENTICATED
        client = _worker(control)
        assert _next(control)[1]["type"] == "hello"
        assert _closed_within(socks[0], 3), "the oldest idle connection was not the one dropped"
        client.close()
    finally:
        for s in socks:
            s.close()


def test_a_slow_partial_frame_does_not_delay_a_worker(control: ControlServer) -> None:
    with socket.create_connection(control.address, timeout=5) as slow:
        slow.sendall(struct.pack(">IQ", 100, 0))  # half a prefix, then nothing
        t0 = time.monotonic()
        client = _worker(control)
        assert _next(control)[1]["type"] == "hello"
        assert time.monotonic() - t0 < 1.0
        client.close()


# -- replay and reflection ------------------------------------------------------------------
class _Recorder:
    """A man in the middle that forwards worker->launcher bytes and keeps a copy."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.target = target
        self.up = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        try:
            while data := src.recv(65536):
                if keep:
                    self.up += data
                dst.sendall(data)
        except OSError:
            pass

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()
        self._pipe(client, server, True)


def test_a_recorded_hello_replayed_on_a_new_connection_is_refused(control: ControlServer) -> None:
    rec = _Recorder(control.address)
    client = _worker_at(rec.address)
    _, msg = _next(control)
    assert msg == {"type": "hello", "worker_id": 0}
    time.sleep(0.2)
    recorded = bytes(rec.up)
    assert len(recorded) > PREFIX_SIZE
    with socket.create_connection(control.address, timeout=5) as replayer:
        _greeted(replayer)  # a fresh nonce, unlike the recording's
        replayer.sendall(recorded[OPENING_SIZE:])  # the recorded hello
        assert _closed_within(replayer, 3)
    assert control.inbox.empty(), "the replayed hello reached the decision loop"
    assert control.rejected >= 1
    client.close()


def _worker_at(address: tuple[str, int]) -> ControlClient:
    client = ControlClient(address, SECRET, lambda m: None, lambda why: None)
    client.send({"type": "hello", "worker_id": 0})
    return client


def test_a_frame_reflected_back_or_sealed_with_the_raw_secret_is_refused(control: ControlServer) -> None:
    with socket.create_connection(control.address, timeout=5) as sock:
        greeting = _greeted(sock)
        # the launcher's own greeting, sent back: sealed with the other direction's key
        send_frame(sock, S2C, {**greeting, "_q": 1, "_n": greeting["nonce"], "_c": "x"})
        assert _closed_within(sock, 3)
    with socket.create_connection(control.address, timeout=5) as sock:
        greeting = _greeted(sock)
        send_frame(sock, SECRET, {"type": "hello", "_q": 1, "_n": greeting["nonce"], "_c": "x"})
        assert _closed_within(sock, 3)
    assert control.inbox.empty()


def test_a_repeated_sequence_number_closes_the_connection(control: ControlServer) -> None:
    with socket.create_connection(control.address, timeout=5) as sock:
        nonce = _greeted(sock)["nonce"]
        send_frame(sock, C2S, {"type": "hello", "_q": 1, "_n": nonce, "_c": "me"})
        _, msg = _next(control)
        assert msg == {"type": "hello"}
        send_frame(sock, C2S, {"type": "hello", "_q": 1, "_n": nonce})  # the same again
        _, msg = _next(control)
        assert msg["type"] == "_closed"
        assert _closed_within(sock, 3)


# -- key server ----------------------------------------------------------------------------
@pytest.fixture
def keyserver() -> Any:
    server = KeyServer("127.0.0.1", 0, SECRET, io_timeout=2.0)
    server.start()
    yield server
    server.stop()


def _ks_request(address: tuple[str, int], header: dict[str, Any]) -> dict[str, Any]:
    with socket.create_connection(address, timeout=5) as sock:
        send_frame(sock, derive_key(SECRET, KEYSERVER_C2S), header)
        return recv_frame(sock, derive_key(SECRET, KEYSERVER_S2C), time.monotonic() + 5)[0]


def test_slow_loris_clients_do_not_delay_another_clients_request(keyserver: KeyServer) -> None:
    addr = ("127.0.0.1", keyserver.port)
    lorises = []
    for _ in range(20):  # each sends a prefix and a few bytes of header, then stalls
        s = socket.create_connection(addr, timeout=5)
        s.sendall(struct.pack(">IQ", 200, 0) + b"\0" * 32 + b'{"op"')
        lorises.append(s)
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        reply = _ks_request(addr, {"op": "ping", "seq": 1})
        took = time.monotonic() - t0
        assert reply["ok"] is True
        assert took < 0.5, f"a ping behind stalled clients took {took:.2f} s"
        # and the stalled ones are closed once their frame stays incomplete for io_timeout
        assert all(_closed_within(s, keyserver.io_timeout + 3) for s in lorises)
    finally:
        for s in lorises:
            s.close()


def test_a_forged_key_server_request_gets_no_sealed_reply(keyserver: KeyServer) -> None:
    addr = ("127.0.0.1", keyserver.port)
    for key in (b"another-secret", SECRET, derive_key(SECRET, KEYSERVER_S2C)):  # forged, raw, reflected
        with socket.create_connection(addr, timeout=5) as sock:
            send_frame(sock, key, {"op": "set", "keys": ["k"], "lens": [1], "seq": 1}, b"x")
            sock.settimeout(3)
            assert sock.recv(65536) == b"", "the server answered a forged request"
    assert keyserver.stats.rejected == 3
    assert keyserver.keyspace.missing(["k"]) == ["k"]


def test_a_key_server_connection_may_announce_a_large_value_only_after_its_first_sealed_frame(
    keyserver: KeyServer,
) -> None:
    # 1 MiB is within the cap for values, but no connection's first frame carries one (a hello
    # or a read comes first): announced before any frame has passed its seal, it is closed at the
    # prefix, so idle connections cannot each make the server buffer up to the cap.
    addr = ("127.0.0.1", keyserver.port)
    with socket.create_connection(addr, timeout=5) as sock:
        sock.sendall(struct.pack(">IQ", 64, 1 << 20) + b"\0" * 32)
        # at the prefix, long before a partial frame's deadline (io_timeout, 2 s here)
        assert _closed_within(sock, 1.0)
    # after a sealed hello the same connection sets a 1 MiB value
    with socket.create_connection(addr, timeout=5) as sock:
        send_frame(sock, derive_key(SECRET, KEYSERVER_C2S), {"op": "hello", "seq": 1})
        (hello, _) = recv_frame(sock, derive_key(SECRET, KEYSERVER_S2C), time.monotonic() + 5)
        value = b"v" * (1 << 20)
        send_frame(
            sock,
            derive_key(SECRET, KEYSERVER_C2S),
            {"op": "set", "keys": ["big"], "lens": [len(value)], "seq": 2, "nonce": hello["nonce"]},
            value,
        )
        (reply, _) = recv_frame(sock, derive_key(SECRET, KEYSERVER_S2C), time.monotonic() + 5)
        assert reply["ok"] is True, reply
    assert keyserver.keyspace.missing(["big"]) == []


def test_an_oversized_key_server_prefix_is_closed_before_the_body(keyserver: KeyServer) -> None:
    before = _rss_bytes()
    with socket.create_connection(("127.0.0.1", keyserver.port), timeout=5) as sock:
        sock.sendall(struct.pack(">IQ", 10, 1 << 40) + b"\0" * 32)
        assert _closed_within(sock, 3)
    assert _rss_bytes() - before < 64 << 20
    assert _ks_request(("127.0.0.1", keyserver.port), {"op": "ping", "seq": 1})["ok"] is True


def test_idle_key_server_connections_are_capped_and_expire_but_a_peer_gets_through() -> None:
    """A local process floods the key server with connections that never send a byte. They hold
    at most max_unsealed descriptors (the oldest makes room for each new one) and each is closed
    once hello_timeout passes; a peer connecting meanwhile is served, and a peer's authenticated
    connection left idle in its pool is kept past hello_timeout."""
    server = KeyServer("127.0.0.1", 0, SECRET, io_timeout=2.0, hello_timeout=1.5, max_unsealed=8)
    server.start()
    addr = ("127.0.0.1", server.port)
    flood = [socket.create_connection(addr, timeout=5) for _ in range(40)]
    try:
        client = PeerClient(PeerTable([f"127.0.0.1:{server.port}"]), SECRET, "g", connect_grace=1.0)
        deadline = time.monotonic() + 5
        reply, _ = client.call(0, ({"op": "set", "keys": ["k"], "lens": [1]}, b"v"), deadline)
        assert reply["ok"] is True
        assert server.stats.peak_connections <= 8 + 2, server.stats.as_dict()
        assert all(_closed_within(s, 1.0) for s in flood[:30]), "the oldest idle ones make room"
        survivors = flood[-8:]
        assert all(_closed_within(s, 1.5 + 2.0) for s in survivors), "idle past hello_timeout"
        assert server.stats.unsealed_closed >= 39, server.stats.as_dict()
        time.sleep(0.5)
        # the peer's pooled connection (a hello passed its seal) is still open and serves again
        reply, _ = client.call(0, ({"op": "count", "prefix": "k"}, b""), time.monotonic() + 5)
        assert reply["count"] == 1 and server.stats.connections == 41, server.stats.as_dict()
        client.close()
    finally:
        for s in flood:
            s.close()
        server.stop()


def test_a_burst_of_peers_larger_than_the_unsealed_quota_is_served() -> None:
    """N peers connect to one owner at once (a fan-out at start-up), more than max_unsealed: the
    owner serves what each has sent before it closes one for room, so every peer is answered."""
    server = KeyServer("127.0.0.1", 0, SECRET, max_unsealed=4)
    server.start()
    server.keyspace.set("k", b"v")
    table = PeerTable([f"127.0.0.1:{server.port}"])
    start = threading.Barrier(24)
    got: list[bytes] = []

    def peer() -> None:
        client = PeerClient(table, SECRET, "g", connect_grace=1.0)
        start.wait()
        _, payload = client.call(0, ({"op": "get", "keys": ["k"], "timeout": 2}, b""), time.monotonic() + 5)
        got.append(bytes(payload))
        client.close()

    threads = [threading.Thread(target=peer) for _ in range(24)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got == [b"v"] * 24, f"{len(got)} of 24 peers answered; {server.stats.as_dict()}"
    finally:
        server.stop()


class _ClosesFirstConnection:
    """A port in front of a real key server that closes its first connection unanswered, as an
    owner does to a fresh connection when a flood of idle ones fills its quota; later ones are
    relayed to the server."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted == 1:
                sock.close()
                continue
            upstream = socket.create_connection(self.target, timeout=5)
            for a, b in ((sock, upstream), (upstream, sock)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_fresh_connection_closed_unanswered_is_retried_once(keyserver: KeyServer, op: str) -> None:
    """The client sends again, on a new connection, a request whose fresh connection was closed
    before any answer: a read, or a write whose nonce handshake had not been answered (so the
    write never left). The write is applied once."""
    keyserver.keyspace.set("r", b"x")
    relay = _ClosesFirstConnection(("127.0.0.1", keyserver.port))
    client = PeerClient(PeerTable([f"127.0.0.1:{relay.port}"]), SECRET, "g", connect_grace=1.0)
    try:
        deadline = time.monotonic() + 5
        shared: list[int] = []  # the caller's own share of a fan-out runs once, retry or not
        if op == "read":
            request = ({"op": "get", "keys": ["r"], "timeout": 2}, b"")
            _, payload = client.fanout({0: request}, deadline, local=lambda: shared.append(1))[0]
            assert bytes(payload) == b"x"
        else:
            request = ({"op": "add", "keys": ["n"], "amount": 1}, b"")
            reply, _ = client.fanout({0: request}, deadline, local=lambda: shared.append(1))[0]
            assert reply["ok"] is True
            reply, _ = client.call(0, ({"op": "add", "keys": ["n"], "amount": 0}, b""), deadline)
            assert reply["value"] == 1, f"the add was applied {reply['value']} times"
        assert relay.accepted == 2, "one retry, on a new connection"
        assert shared == [1], f"the local share ran {len(shared)} times"
    finally:
        client.close()
        relay.close()


# -- files ---------------------------------------------------------------------------------
def test_the_secret_refuses_a_pre_created_file_and_a_symlink(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert make_run_dir(run) is True
    assert run.stat().st_mode & 0o777 == 0o700
    planted = run / "secret"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    with pytest.raises(ConfigError, match="already exists"):
        write_secret(planted, b"s3cret")
    assert planted.read_bytes() == b""  # nothing written into someone else's file
    planted.unlink()
    target = tmp_path / "elsewhere"
    planted.symlink_to(target)
    with pytest.raises(ConfigError, match="already exists"):
        write_secret(planted, b"s3cret")
    assert not target.exists()
    planted.unlink()
    write_secret(planted, b"s3cret")
    assert planted.stat().st_mode & 0o777 == 0o600 and planted.read_bytes() == b"s3cret"


def test_a_symlinked_run_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        make_run_dir(tmp_path / "link")


def test_remove_early_keeps_a_run_dir_it_did_not_create(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    write_secret(run / "secret", b"s")
    remove_early(run, False, run / "secret")
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_event_logs_do_not_follow_symlinks(tmp_path: Path) -> None:
    from checkpointless.events import EventLog

    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / "events.jsonl").symlink_to(target)
    with pytest.raises(OSError, match="symlink"):
        EventLog(tmp_path / "events.jsonl")
    assert target.read_text() == "precious\n"
    log = EventLog(tmp_path / "rank-0.jsonl")
    log.emit("x")
    log.close()
    assert (tmp_path / "rank-0.jsonl").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(60)
def test_a_busy_control_port_leaves_no_secret_behind(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = tmp_path / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "checkpointless", "run", "--run-dir", str(run), "--control-port", str(port),
             "--nproc", "1", str(SCRIPTS / "slow_steps.py")],
            capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert not (run / "secret").exists()
    assert not run.exists(), list(run.iterdir())  # created by this launch, and empty: removed


def test_a_crowded_port_range_leaves_no_secret_and_no_coordinator_record(tmp_path: Path) -> None:
    # fails after the control server started and the coordinator's address was recorded (when
    # the host's agent looks for its ports): the record goes with everything else (the launcher
    # removes it, and so does its reaper)
    run = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        base = s.getsockname()[1]  # busy: 9 of the 10 ports an agent of one rank needs are free
        proc = subprocess.run(
            [sys.executable, "-m", "checkpointless", "run", "--run-dir", str(run), "--port-base", str(base),
             "--port-range", "10", "--nproc", "1", str(SCRIPTS / "slow_steps.py")],
            capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "ports needed are free" in proc.stderr, proc.stderr
    assert not run.exists(), list(run.iterdir())  # no secret, no record: removed whole


def test_the_shm_name_is_private_and_unguessable(monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpointless.config import job_shm_name

    monkeypatch.delenv("CHECKPOINTLESS_SHM_KEY", raising=False)
    assert job_shm_name("job42") == "checkpointless-job42"
    monkeypatch.setenv("CHECKPOINTLESS_SHM_KEY", "0123456789abcdef0123456789abcdef")
    name = job_shm_name("job42")
    assert name == f"checkpointless-{os.geteuid()}-0123456789abcdef0123456789abcdef"
    assert "job42" not in name  # the public job id gives nothing away
    monkeypatch.setenv("CHECKPOINTLESS_SHM_KEY", "../../etc")
    with pytest.raises(ConfigError, match="CHECKPOINTLESS_SHM_KEY"):
        job_shm_name("job42")


# -- network exposure ----------------------------------------------------------------------
def test_the_tcp_store_listens_on_the_job_interface_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--rendezvous tcp on 127.0.0.2 must not be reachable on 127.0.0.1 (another interface)."""
    from checkpointless.launcher.model import LaunchConfig
    from checkpointless.launcher.store import JobStore

    cfg = LaunchConfig(
        script=str(SCRIPTS / "slow_steps.py"),
        nproc=1,
        host="127.0.0.2",
        rendezvous="tcp",
        run_dir=tmp_path / "run",
    )
    store = JobStore(cfg)
    try:
        desc = store.description
        assert desc["host"] == "127.0.0.2"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.2", desc["port"])) == 0
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", desc["port"])) != 0
    finally:
        store.close()
