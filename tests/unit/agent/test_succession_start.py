"""A process that starts while the coordinator is lost: its agent hands it the succession in its
environment (agent/agent.py), its link reconnects to the successor with it (recovery/link_failover.py), and
the successor keeps a spare that was starting then (coordinator/rules/rebuild.py)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from checkpointless.agent.agent import Agent, AgentConfig
from checkpointless.config import ENV, WorkerEnv
from checkpointless.coordinator.rules.rebuild import ProcReport, WorkerReport, rebuild
from checkpointless.launcher.control import ControlServer
from checkpointless.launcher.policy import Limits
from checkpointless.protocol import (
    SUCCESSION_ENV,
    Heartbeat,
    Prepare,
    ProtocolError,
    Succession,
    succession_from_env,
    succession_to_env,
)
from checkpointless.protocol.beats import BEAT_ENV
from checkpointless.recovery.link import LauncherLink

pytestmark = pytest.mark.timeout(60)
SUCC = Succession(term=2, members=[0, 1, 2], successors=[1, 2], addresses=["10.0.0.1:4000"], lease=3.0)


def test_the_succession_travels_in_the_environment() -> None:
    assert succession_from_env(succession_to_env(SUCC)) == SUCC
    assert succession_from_env(None) is None and succession_from_env("") is None
    with pytest.raises(ProtocolError, match=SUCCESSION_ENV):
        succession_from_env("{not json")
    with pytest.raises(ProtocolError, match="not a succession"):
        succession_from_env('{"type": "done"}')


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))


def test_the_agent_gives_new_processes_the_newest_succession(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        f"import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get({SUCCESSION_ENV!r}, 'unset'))\n"
    )
    cfg = AgentConfig(
        python=sys.executable,
        script=str(script),
        script_args=[],
        host="127.0.0.1",
        run_dir=tmp_path,
        nproc=1,
        rendezvous="tcp",
        port_base=29600,
        port_range=10,
        limits=Limits(hang_timeout=10, start_timeout=10),
        fork_server=False,
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV.JOB_ID}
    agent = Agent(cfg, env, _Events())
    try:
        agent.cfg.script_args.append(str(tmp_path / "before"))
        agent.spawn(0, "spare")  # before any succession: nothing to pass
        agent.succession = SUCC
        agent.cfg.script_args[0] = str(tmp_path / "after")
        agent.spawn(1, "spare")
    finally:
        agent.close(grace=20)
    assert (tmp_path / "before").read_text() == "unset"
    assert succession_from_env((tmp_path / "after").read_text()) == SUCC


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: a connection there is refused


def test_a_starting_link_without_its_coordinator_reconnects_to_the_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BEAT_ENV, raising=False)
    secret = b"cd" * 32
    successor = ControlServer("127.0.0.1", 0, secret)
    successor.start()
    host, port = successor.address
    succ = Succession(term=4, members=[0, 1, 2], successors=[1], addresses=[f"{host}:{port}"], lease=1.0)
    monkeypatch.setenv(SUCCESSION_ENV, succession_to_env(succ))
    env = WorkerEnv(("127.0.0.1", _dead_port()), secret, 9, "spare", tmp_path, "job", 0, "127.0.0.1")
    started = time.monotonic()
    link = LauncherLink(env, lambda m: None, Heartbeat, heartbeat_s=60.0)
    try:
        conn, hello = successor.inbox.get(timeout=10)
        # a reconnect hello (a term past the one it knew), as a process that holds no rank
        assert hello["type"] == "hello" and hello["worker_id"] == 9 and hello["role"] == "spare"
        assert hello["term"] == 5 and hello["rank"] == -1
        assert time.monotonic() - started < 5, "the dead coordinator must not eat the election window"
        conn.send({"type": "prepare", "state_bytes": 1})  # the successor talks to it like any other
        got = link.wait_for((Prepare,), time.monotonic() + 10)
        assert got.state_bytes == 1
    finally:
        link.close()
        successor.stop()


def test_without_a_succession_a_starting_link_still_fails_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SUCCESSION_ENV, raising=False)
    env = WorkerEnv(("127.0.0.1", _dead_port()), b"ef" * 32, 3, "worker", tmp_path, "job", 0, "127.0.0.1")
    with pytest.raises(ConnectionError, match="cannot reach the launcher"):
        LauncherLink(env, lambda m: None, Heartbeat, heartbeat_s=60.0)


def test_rebuild_keeps_a_spare_that_was_starting_and_kills_a_starting_worker() -> None:
    procs = [
        ProcReport(0, 0, "worker", 100),
        ProcReport(1, 0, "worker", 101),
        ProcReport(2, 1, "spare", 102, connected=False),  # starting: reconnects once up
        ProcReport(3, 1, "worker", 103, connected=False),  # a starting replacement worker
        ProcReport(4, 1, "spare", 104),  # was connected and never came back
    ]
    workers = [WorkerReport(0, 0, 2, 30), WorkerReport(1, 1, 2, 30)]
    r = rebuild(procs, workers, nproc=2)
    assert r.kill == [3, 4]
    assert r.ranks == {0: 0, 1: 1} and r.missing == []
