"""Joining, hardened (issue 36): real agents on loopback against a real coordinator, a coordinator
of another job, and an endpoint that replays a recorded greeting.

- a wrong secret ends the agent at once with one error line and exit 2, after a handful of
  connections (it made 17k in 6 s before);
- a replayed greeting is refused on the spot and the agent goes on to ``--coordinator``;
- the secret file is read as a small regular file, never blocking on a FIFO;
- a second agent for a live host is refused with that host's name, and the coordinator warns.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpointless.agent.join import backoff
from checkpointless.launcher.control import AUTH_DEADLINE_S, ControlServer
from checkpointless.launcher.runfiles import COORDINATOR_FILE, record_coordinator, recorded_coordinator
from checkpointless.protocol.agent_link import SHM_KEY_LABEL
from checkpointless.protocol.control_channel import OPENING_SIZE, opening
from checkpointless.wire import PREFIX_SIZE, FrameAuthError, open_value, seal_value
from tests.helpers.wait import deadline_in, wait_for

pytestmark = pytest.mark.timeout(90)

LOOP = "127.0.0.1"


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m checkpointless ARGV`` in a session of its own, its stderr (the log) to ``log``."""
    with open(log, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "checkpointless", *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


def _agent(secret_file: Path, coordinator: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = ["agent", "--coordinator", coordinator, "--host", LOOP, "--secret-file", str(secret_file)]
    return _start([*argv, *extra], log)


def _stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "checkpointless: error:" in line]


class _Endpoint:
    """A listening socket on loopback that counts its connections and serves each with
    ``serve(sock)`` (on a thread per connection)."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server((LOOP, 0))
        self.address = f"{LOOP}:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._serve = serve
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._socks.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


def _proxy_to(target: tuple[str, int], down: bytearray | None = None) -> Callable[[socket.socket], None]:
    """A ``serve`` that relays bytes both ways to ``target`` (so the endpoint counts connections
    made to a real server), keeping what the server sends in ``down``."""

    def pipe(src: socket.socket, dst: socket.socket, keep: bytearray | None = None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve(sock: socket.socket) -> None:
        upstream = socket.create_connection(target)
        threading.Thread(target=pipe, args=(upstream, sock, down), daemon=True).start()
        pipe(sock, upstream)

    return serve


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[str, Path, Path, int]]:
    """A real `checkpointless coordinator` waiting for 2 hosts (so no job starts and no worker
    runs): its address, run directory, log and pid."""
    run_dir = tmp_path / "run"
    log = tmp_path / "coordinator.log"
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = ["coordinator", "--nnodes", "2", "--nproc-per-node", "1", "--host", LOOP, "--control-port", "0"]
    proc = _start([*argv, "--run-dir", str(run_dir), "--agent-wait", "80", str(script)], log)
    try:
        wait_for(
            lambda: recorded_coordinator(run_dir / COORDINATOR_FILE) is not None,
            deadline_in(30),
            "the coordinator",
        )
        address = recorded_coordinator(run_dir / COORDINATOR_FILE)
        assert address is not None
        yield address, run_dir, log, proc.pid
    finally:
        _stop(proc)


def test_a_wrong_secret_ends_the_agent_with_one_error_and_few_connections(tmp_path: Path) -> None:
    # a coordinator of another job: a real control server, whose secret the agent does not hold
    server = ControlServer(LOOP, 0, b"the-other-jobs-secret")
    server.start()
    counter = _Endpoint(_proxy_to(server.address))
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    log = tmp_path / "agent.log"
    agent = _agent(secret, counter.address, log)  # --connect-timeout: the default 60 s
    try:
        t0 = time.monotonic()
        assert agent.wait(30) == 2, log.read_text()
        took = time.monotonic() - t0
    finally:
        _stop(agent)
        counter.close()
        server.stop()
    errors = _error_lines(log)
    assert len(errors) == 1, log.read_text()
    assert "wrong job secret" in errors[0] and str(secret) in errors[0] and "<run dir>/secret" in errors[0]
    assert counter.connections <= 10, counter.connections
    assert took < 20, took
    assert log.read_text().count("cannot join") <= 1, log.read_text()  # no warning storm


def _recorded_greeting(address: str) -> bytes:
    """One real greeting frame, byte for byte, as the coordinator sent it to a connection."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(opening()[0])
        buf = b""
        while len(buf) < PREFIX_SIZE:
            buf += sock.recv(PREFIX_SIZE - len(buf))
        need = PREFIX_SIZE + int.from_bytes(buf[:4], "big") + int.from_bytes(buf[4:12], "big")
        while len(buf) < need:
            buf += sock.recv(need - len(buf))
        return buf


def _replayer(greeting: bytes, heard: list[bytes]) -> Callable[[socket.socket], None]:
    """An endpoint without the secret: it answers every opening with a recorded greeting and
    keeps whatever the agent says next in ``heard``."""

    def replay(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            got = b""
            while len(got) < OPENING_SIZE:
                got += sock.recv(OPENING_SIZE - len(got)) or b"x" * OPENING_SIZE
            sock.sendall(greeting)
            sock.settimeout(10)
            while data := sock.recv(65536):
                heard.append(data)

    return replay


def test_a_replayed_greeting_is_refused_and_the_agent_joins_its_coordinator(
    coordinator: tuple[str, Path, Path, int], tmp_path: Path
) -> None:
    address, run_dir, coord_log, _ = coordinator
    greeting = _recorded_greeting(address)
    heard: list[bytes] = []

    fake = _Endpoint(_replayer(greeting, heard))
    # the agent's run directory records the fake (a stale record, a hostile one); --coordinator
    # names the real coordinator
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "secret").write_bytes((run_dir / "secret").read_bytes())
    record_coordinator(agent_dir, fake.address)
    log = tmp_path / "agent.log"
    t0 = time.monotonic()
    agent = _agent(agent_dir / "secret", address, log, "--connect-timeout", "30")
    try:
        wait_for(
            lambda: "joined job" in log.read_text() or agent.poll() is not None,
            deadline_in(30),
            "the agent to join",
        )
        took = time.monotonic() - t0
        assert "joined job" in log.read_text(), log.read_text()
        assert fake.connections >= 1, "the agent never tried the recorded address"
        assert "replayed greeting" in log.read_text(), log.read_text()
        assert heard == [], "the agent spoke to an endpoint whose greeting it could not trust"
        assert took < 15, took  # the fake cost one refused try, not a 10 s wait
        wait_for(
            lambda: "agent 0 joined" in coord_log.read_text(),
            deadline_in(10),
            "the coordinator to see the agent",
        )
    finally:
        _stop(agent)
        fake.close()


def test_retries_back_off_and_an_agent_nobody_welcomes_says_so(
    coordinator: tuple[str, Path, Path, int], tmp_path: Path
) -> None:
    """Only a replaying endpoint to ask: each round fails at once, and the rounds back off (20 ms
    doubling to 2 s, jittered) instead of hot-looping until --connect-timeout."""
    address, run_dir, _, _ = coordinator
    heard: list[bytes] = []
    fake = _Endpoint(_replayer(_recorded_greeting(address), heard))
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "secret").write_bytes((run_dir / "secret").read_bytes())
    log = tmp_path / "agent.log"
    agent = _agent(agent_dir / "secret", fake.address, log, "--connect-timeout", "6")
    try:
        assert agent.wait(30) == 1, log.read_text()
    finally:
        _stop(agent)
        fake.close()
    # 6 s of backoff is about 11 rounds; a hot loop made thousands
    assert 3 <= fake.connections <= 16, fake.connections
    assert heard == []
    text = log.read_text()
    assert text.count("replayed greeting") == 1, text  # one warning per address, not per try
    assert "no coordinator welcomed this agent within --connect-timeout 6 s" in text, text


def test_backoff_doubles_with_jitter_and_is_bounded() -> None:
    for rounds in range(40):
        pauses = [backoff(rounds) for _ in range(50)]
        top = min(2.0, 0.02 * 2**rounds)
        assert all(top / 2 <= x <= top for x in pauses), (rounds, pauses)
        assert len(set(pauses)) > 1  # jittered


def test_a_second_agent_for_a_live_host_is_refused_with_its_name(
    coordinator: tuple[str, Path, Path, int], tmp_path: Path
) -> None:
    address, run_dir, coord_log, _ = coordinator
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = _agent(run_dir / "secret", address, first_log)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: "joined job" in first_log.read_text(), deadline_in(30), "the first agent to join")
        second = _agent(run_dir / "secret", address, second_log)
        assert second.wait(30) == 2, second_log.read_text()
        errors = _error_lines(second_log)
        assert len(errors) == 1, second_log.read_text()
        assert f"host {LOOP} is served by agent 0 already" in errors[0], errors
        assert "refused an agent from 127.0.0.1" in coord_log.read_text(), coord_log.read_text()
        assert first.poll() is None, "the live host's agent must keep serving"
    finally:
        if second is not None:
            _stop(second)
        _stop(first)


def _headers(stream: bytes) -> list[dict[str, Any]]:
    """The headers of the sealed frames in ``stream`` (as a relay sees them, seals unchecked)."""
    out = []
    while len(stream) >= PREFIX_SIZE:
        hlen, plen = int.from_bytes(stream[:4], "big"), int.from_bytes(stream[4:12], "big")
        out.append(json.loads(stream[PREFIX_SIZE : PREFIX_SIZE + hlen]))
        stream = stream[PREFIX_SIZE + hlen + plen :]
    return out


def test_a_relay_in_the_middle_of_a_join_reads_no_shm_key(
    coordinator: tuple[str, Path, Path, int], tmp_path: Path
) -> None:
    """Issue 36: an endpoint relaying a real join both ways read the welcome in clear, shm_key
    included. The relay still passes the join through (it only forwards sealed frames), but the
    key it carries is encrypted: nothing of it is in the bytes the relay saw."""
    address, run_dir, _, _ = coordinator
    host, _, port = address.rpartition(":")
    down = bytearray()
    relay = _Endpoint(_proxy_to((host, int(port)), down))
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "secret").write_bytes((run_dir / "secret").read_bytes())
    record_coordinator(agent_dir, relay.address)  # the record names the relay
    log = tmp_path / "agent.log"
    agent = _agent(agent_dir / "secret", address, log, "--connect-timeout", "30")
    try:
        wait_for(
            lambda: "joined job" in log.read_text() or agent.poll() is not None,
            deadline_in(30),
            "the agent to join",
        )
        assert "joined job" in log.read_text(), log.read_text()
        assert relay.connections == 1
        welcome = next(h for h in _headers(bytes(down)) if h.get("type") == "agent_welcome")
        # what a holder of the secret reads in it: the job's key (32 hex digits) ...
        shm_key = open_value((run_dir / "secret").read_bytes().strip(), SHM_KEY_LABEL, welcome["shm_key"])
        assert re.fullmatch(rb"[0-9a-f]{32}", shm_key), shm_key
        # ... and what the relay read: nothing of it
        assert shm_key not in down and shm_key.decode() not in json.dumps(welcome), "the relay read the key"
    finally:
        _stop(agent)
        relay.close()


def test_sealed_values_open_only_with_the_same_secret_and_label() -> None:
    token = seal_value(b"s" * 32, "control/welcome/shm_key", b"0123456789abcdef")
    assert open_value(b"s" * 32, "control/welcome/shm_key", token) == b"0123456789abcdef"
    assert seal_value(b"s" * 32, "control/welcome/shm_key", b"x") != seal_value(
        b"s" * 32, "control/welcome/shm_key", b"x"
    )  # a fresh nonce each time
    for secret, label, tok in [
        (b"t" * 32, "control/welcome/shm_key", token),  # another job's secret
        (b"s" * 32, "other", token),  # another label
        (b"s" * 32, "control/welcome/shm_key", token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]),
        (b"s" * 32, "control/welcome/shm_key", "!!not base64!!"),
        (b"s" * 32, "control/welcome/shm_key", ""),
        (b"s" * 32, "control/welcome/shm_key", "A" * 5000),
    ]:
        with pytest.raises(FrameAuthError):
            open_value(secret, label, tok)


def test_the_control_server_greets_only_an_opening_of_this_version() -> None:
    server = ControlServer(LOOP, 0, b"k" * 32)
    server.start()
    try:
        # version 2's client sends nothing and waits for a greeting: none comes, it is closed
        with socket.create_connection(server.address, timeout=5) as old:
            old.settimeout(AUTH_DEADLINE_S + 3)
            assert old.recv(1) == b""
        # an opening with another magic (or version) is closed at once, with no greeting
        with socket.create_connection(server.address, timeout=5) as other:
            other.sendall(b"cl-ctl\x00\x02" + bytes(16))
            other.settimeout(1.5)
            assert other.recv(1) == b""
        assert server.rejected >= 2
    finally:
        server.stop()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_to_fifo(path: Path) -> None:
    _fifo(path.parent / "fifo")
    path.symlink_to(path.parent / "fifo")


def _writes(content: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content) and None


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_fifo, "is a FIFO, not a regular file"),
        (_symlink_to_fifo, "is a FIFO, not a regular file"),
        (Path.mkdir, "is a directory, not a regular file"),
        (_writes(b""), "is empty"),
        (_writes(b"\n \n"), "is empty"),
        (_writes(b"a" * 5000), "holds more than 4096 bytes"),
    ],
    ids=["fifo", "symlink-to-fifo", "directory", "empty", "blank", "oversized"],
)
def test_a_secret_file_that_is_not_a_small_regular_file_is_a_clear_error(
    tmp_path: Path, make: Callable[[Path], None], says: str
) -> None:
    secret = tmp_path / "secret"
    make(secret)
    log = tmp_path / "agent.log"
    t0 = time.monotonic()
    # --connect-timeout 60: a FIFO must not block, an empty file must not be waited on that long
    agent = _agent(secret, f"{LOOP}:9", log)
    try:
        assert agent.wait(30) == 2, log.read_text()
    finally:
        _stop(agent)
    errors = _error_lines(log)
    assert len(errors) == 1 and says in errors[0] and "<run dir>/secret" in errors[0], log.read_text()
    assert "did not appear" not in errors[0]
    assert time.monotonic() - t0 < 20


def test_hosts_that_share_an_address_on_purpose_are_told_apart_by_their_node() -> None:
    """Several Slurm nodes on one machine (one slurmd each, tests/multihost/test_slurm_jobs.py) share its
    address and hostname: each agent's node name (SLURMD_NODENAME) keeps them apart; the same
    node again is refused, the same agent rejoining is not, and a host whose node a successor
    never learned is never claimed."""
    from checkpointless.launcher.agents import claimed_host
    from checkpointless.protocol import AgentHello

    live: list[tuple[int, str, str | None, str | None]] = [(0, LOOP, f"{LOOP}:4000", "n1")]
    assert claimed_host(live, AgentHello(host=LOOP, failover=f"{LOOP}:4001", node="n2")) is None
    assert claimed_host(live, AgentHello(host=LOOP, failover=f"{LOOP}:4001", node="n1")) == 0
    assert claimed_host(live, AgentHello(host=LOOP, failover=f"{LOOP}:4000", node="n1")) is None
    assert claimed_host(live, AgentHello(host="10.9.9.9", failover="x:1", node="n1")) is None
    unknown: list[tuple[int, str, str | None, str | None]] = [(0, LOOP, f"{LOOP}:4000", None)]
    assert claimed_host(unknown, AgentHello(host=LOOP, failover=f"{LOOP}:4001", node="n1")) is None
