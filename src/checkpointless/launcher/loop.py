"""The coordinator's decision loop: observations in, commands out.

:class:`DecisionLoop` is the part of a coordinator's shell that runs while the job does. It reads
the control server's inbox, the embedded agent's process exits and verdicts and its heartbeat
records, feeds each to the :class:`~checkpointless.coordinator.Coordinator`, and carries out the
commands it returns: through the embedded agent and the remote ones
(:class:`~checkpointless.launcher.agents.AgentHosts`: start and kill processes, the peer table),
the workers' control connections (messages, which this loop owns) and the event log. The shell
around it (``launcher.py``, ``takeover.py``) sets the job up and tears it down.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

from checkpointless.agent import Agent, ProcExit
from checkpointless.coordinator import Coordinator, Emit, HostTable, Kill, Log, Send, Spawn, Stop
from checkpointless.events import EventLog, get_logger
from checkpointless.launcher.agents import AgentHosts
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.outcome import Outcome
from checkpointless.launcher.policy import loop_wait
from checkpointless.protocol import (
    AgentHeartbeat,
    AgentHello,
    Heartbeat,
    Hello,
    KillCmd,
    ProcConnected,
    ProtocolError,
    SpareReady,
    SpawnCmd,
    Vote,
    decode,
    encode,
)

__all__ = ["DecisionLoop"]

log = get_logger()
_BEATS = frozenset({Heartbeat.TYPE, AgentHeartbeat.TYPE})  # messages that are not events (loop_wait)
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_LOCAL_BEATS_S = 0.25  # how often the embedded agent's heartbeat records are read


class DecisionLoop:
    """Feeds one coordinator what happens and carries out what it decides, on one thread."""

    def __init__(
        self,
        cfg: LaunchConfig,
        coordinator: Coordinator,
        server: ControlServer,
        hosts: AgentHosts,
        events: EventLog,
        outcome: Outcome,
        *,
        local: Agent | None,
        local_host: int | None,
        on_executed: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self.server = server
        self.hosts = hosts
        self.events = events
        self.outcome = outcome
        self.local = local  # the embedded agent, if this shell has one
        self.local_host = local_host  # its host id
        self._on_executed = on_executed  # after every execute (a takeover's first recovery)
        self._workers: dict[int, Connection] = {}  # worker id -> its control connection
        self._last_event = 0.0  # monotonic time of the loop's last event (policy.loop_wait)

    # -- the workers' connections --------------------------------------------------------------
    def attach_worker(self, worker_id: int, conn: Connection) -> None:
        """``conn`` is ``worker_id``'s connection from now on (its hello was accepted)."""
        conn.worker_id = worker_id
        self._workers[worker_id] = conn

    def detach_worker(self, conn: Connection) -> bool:
        """A closed connection: forget it if it is a worker's current one (True then)."""
        if conn.worker_id is not None and self._workers.get(conn.worker_id) is conn:
            del self._workers[conn.worker_id]
            return True
        return False

    def announce(self, only: Connection | None = None) -> None:
        """Tell agents and workers who may take over (all of them, or just ``only``)."""
        succession = self.hosts.succession(time.monotonic(), record=only is None)
        if succession is None:
            return
        if self.local is not None:
            self.local.succession = succession  # for the processes this host starts from now on
        msg = encode(succession)
        targets = [only] if only is not None else [*self.hosts.connections(), *self._workers.values()]
        for conn in targets:
            conn.send(msg)

    # -- the loop ------------------------------------------------------------------------------
    def wait_for_agents(self) -> bool:
        """Wait for the job's hosts: --nnodes plus --spare-nodes agents (the embedded one counts)."""
        coord, cfg = self.coordinator, self.cfg
        deadline = time.monotonic() + cfg.agent_wait
        log.info("waiting for %d agents on %s:%d", cfg.agents_needed, *self.server.address[:2])
        while len([h for h in coord.hosts.values() if not h.lost]) < cfg.agents_needed:
            signum = self.outcome.signal
            if signum is not None or time.monotonic() > deadline:
                why = (
                    f"launcher received {signal.Signals(signum).name}"
                    if signum is not None
                    else f"only {len(coord.hosts)} of {cfg.agents_needed} agents joined within "
                    f"{cfg.agent_wait:.0f} s; start `checkpointless agent --coordinator "
                    f"{cfg.host}:{self.server.address[1]}` on each host"
                )
                coord.fail(why)
                self.execute()
                return False
            self._drain_inbox()
            self.execute()
        return True

    def run(self) -> None:
        """Until the coordinator stops the job, a signal arrives or this coordinator steps down."""
        coord, agent = self.coordinator, self.local
        beats_read = 0.0
        while self.outcome.stopping is None:
            signum = self.outcome.signal
            if signum is not None:
                coord.on_signal(signal.Signals(signum).name, 128 + signum)
                self.execute()
                return
            self._drain_inbox()
            now, wall = time.monotonic(), time.time()
            if self.hosts.membership_changed(now):
                self.announce()  # a lost host aged out of the membership
            if self.hosts.lost_majority(now):
                return
            for seen in agent.poll(now) if agent is not None else []:
                self._last_event = now
                if isinstance(seen, ProcExit):
                    # its connection stays until it closes: frames it sent before it exited (its
                    # Done) are still to be read, and the coordinator waits for them
                    coord.on_exit(
                        seen.worker_id, seen.code, seen.own_failure, seen.detail, seen.tail, now, wall
                    )
                else:
                    coord.on_verdict(seen.worker_id, f"(pid {seen.pid}) {seen.why}", now)
            if agent is not None and self.local_host is not None and now - beats_read >= _LOCAL_BEATS_S:
                beats_read = now  # the embedded agent's beats (host 0, or an elected agent's own)
                coord.on_beats(self.local_host, agent.read_beats(now), now)
            coord.tick(now, wall)
            self.execute()

    def _drain_inbox(self) -> None:
        wait = loop_wait(time.monotonic(), self._last_event, self.coordinator.settled())
        try:
            conn, msg = self.server.inbox.get(timeout=wait)
            self._note(msg)
            self.receive(conn, msg)
            while True:
                conn, msg = self.server.inbox.get_nowait()
                self._note(msg)
                self.receive(conn, msg)
        except queue.Empty:
            pass

    def _note(self, raw: dict[str, Any]) -> None:
        # heartbeats (a worker's, four times a second; a host agent's, twice) are not events
        if raw.get("type") not in _BEATS:
            self._last_event = time.monotonic()

    def receive(self, conn: Connection, raw: dict[str, Any]) -> None:
        """One message (or connection end) from the control server's inbox."""
        coord = self.coordinator
        now = time.monotonic()
        if raw.get("type") == "_closed":
            host = self.hosts.drop(conn)
            if host is not None:
                coord.on_host_lost(host, "its agent's connection closed", now, time.time())
                self.execute()
            elif self.detach_worker(conn):
                assert conn.worker_id is not None
                coord.on_closed(conn.worker_id)
            return
        try:
            msg = decode(raw)
        except ProtocolError as e:
            log.warning("closing a control connection: %s", e)
            conn.hang_up()
            return
        if self.hosts.is_agent(conn) or isinstance(msg, AgentHello):
            if self.hosts.on_message(conn, msg, now):
                self.announce()  # an agent joined
            self.execute()
            return
        late = isinstance(msg, Hello) and msg.term > 0 and not coord.awaits_late_hello(msg.worker_id)
        if isinstance(msg, Vote) or late:
            # a vote or a reconnect after a failover: one that arrives once the new coordinator
            # has rebuilt its state is too late (its process was not vouched for), except from a
            # spare that was starting then (it had no connection to lose; rebuild.py kept it)
            conn.hang_up()
            return
        if isinstance(msg, Hello):
            self._hello(conn, msg, now)
            self.execute()
            return
        if conn.worker_id is None or self._workers.get(conn.worker_id) is not conn:
            return  # nothing but hello before a connection has said who it is
        coord.on_message(conn.worker_id, msg, now, time.time())
        self.execute()

    def _hello(self, conn: Connection, msg: Hello, now: float) -> None:
        coord = self.coordinator
        if conn.worker_id is not None or not coord.on_connected(msg.worker_id, now):
            conn.hang_up()  # a process we did not start (or of a lost host), or a second hello
            return
        self.attach_worker(msg.worker_id, conn)
        host = coord.procs[msg.worker_id].host
        if not self.hosts.send(host, ProcConnected(msg.worker_id)) and self.local is not None:
            self.local.mark_connected(msg.worker_id)
        self.announce(conn)
        if msg.term > 0 and msg.ready:
            # a spare that was starting at the failover: its SpareReady went nowhere (it had
            # nobody to send it to); its hello says it instead
            coord.on_message(msg.worker_id, SpareReady(), now, time.time())

    def execute(self) -> None:
        """Carry out what the coordinator decided, in order."""
        coord, agent, hosts = self.coordinator, self.local, self.hosts
        local = self.local_host
        while commands := coord.drain():
            for c in commands:
                if isinstance(c, Send):
                    conn = self._workers.get(c.worker_id)
                    if conn is not None:
                        conn.send(encode(c.message))
                elif isinstance(c, Spawn):
                    if hosts.has(c.host):
                        hosts.send(c.host, SpawnCmd(c.worker_id, c.role))
                    elif agent is not None and c.host == local:
                        coord.on_started(c.worker_id, agent.spawn(c.worker_id, c.role))
                elif isinstance(c, HostTable):
                    # before the plans that name its version go out, in this same pass: the
                    # embedded agent has the file written by then; a remote one gets the chunks
                    # first on its own connection
                    for chunk in c.chunks:
                        if hosts.has(c.host):
                            hosts.send(c.host, chunk)
                        elif agent is not None and c.host == local:
                            agent.on_table_chunk(chunk)
                elif isinstance(c, Kill):
                    if hosts.has(c.host):
                        hosts.send(c.host, KillCmd(c.worker_id, c.why))
                    elif agent is not None and c.host == local:
                        agent.kill(c.worker_id, c.why)
                elif isinstance(c, Emit):
                    self.events.emit(c.event, **c.fields)
                elif isinstance(c, Log):
                    log.log(_LEVELS.get(c.level, logging.INFO), "%s", c.text)
                elif isinstance(c, Stop):
                    self.outcome.stop(c.why, c.code)
        if hosts.cut_off_fenced():
            self.announce()  # the membership a majority is counted against has shrunk
        if self._on_executed is not None:
            self._on_executed()
