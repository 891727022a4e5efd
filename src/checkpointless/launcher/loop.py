"""The launcher's decision loop: observations in, commands out.

A mixin of :class:`~checkpointless.launcher.launcher.Launcher` (and so of the takeover shell),
kept apart from the shell that sets the job up and tears it down (``launcher.py``): this is the
part that runs while the job does. It reads the control server's inbox, the embedded agent's
process exits and verdicts and its heartbeat records, feeds each to the
:class:`~checkpointless.coordinator.Coordinator`, and carries out the commands it returns through
the agents (start and kill processes, the peer table) and the control channel (messages). It
builds on :class:`~checkpointless.launcher.agents.AgentHosts`, whose remote agents and succession
it serves; the attributes it reads beyond those are the launcher's, declared below for the type
checker.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from typing import Any

from checkpointless.agent import ProcExit
from checkpointless.coordinator import Emit, HostTable, Kill, Log, Send, Spawn, Stop
from checkpointless.events import get_logger
from checkpointless.launcher.agents import AgentHosts
from checkpointless.launcher.control import Connection
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


class DecisionLoop(AgentHosts):
    """The decision loop of a :class:`Launcher` (which sets every attribute here)."""

    _last_event: float  # monotonic time of the loop's last event (policy.loop_wait)
    _local_host: int | None  # the embedded agent's id

    def _drain_inbox(self) -> None:
        assert self.coordinator is not None
        wait = loop_wait(time.monotonic(), self._last_event, self.coordinator.settled())
        try:
            conn, msg = self.server.inbox.get(timeout=wait)
            self._note(msg)
            self._receive(conn, msg)
            while True:
                conn, msg = self.server.inbox.get_nowait()
                self._note(msg)
                self._receive(conn, msg)
        except queue.Empty:
            pass

    def _note(self, raw: dict[str, Any]) -> None:
        # heartbeats (a worker's, four times a second; a host agent's, twice) are not events
        if raw.get("type") not in _BEATS:
            self._last_event = time.monotonic()

    def _loop(self) -> None:
        coord, agent = self.coordinator, self.agent
        assert coord is not None
        beats_read = 0.0
        while self.stopping is None:
            if self._signal is not None:
                coord.on_signal(signal.Signals(self._signal).name, 128 + self._signal)
                self._execute()
                return
            self._drain_inbox()
            now, wall = time.monotonic(), time.time()
            if self._lost_majority(now):
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
            if agent is not None and self._local_host is not None and now - beats_read >= 0.25:
                beats_read = now  # the embedded agent's beats (host 0, or an elected agent's own)
                coord.on_beats(self._local_host, agent.read_beats(now), now)
            coord.tick(now, wall)
            self._execute()

    def _receive(self, conn: Connection, raw: dict[str, Any]) -> None:
        coord, agent = self.coordinator, self.agent
        assert coord is not None
        now = time.monotonic()
        if raw.get("type") == "_closed":
            if conn in self._agent_of:
                host = self._agent_of.pop(conn)
                self._agents.pop(host, None)
                coord.on_host_lost(host, "its agent's connection closed", now, time.time())
                self._execute()
            elif conn.worker_id is not None and self._conns.get(conn.worker_id) is conn:
                del self._conns[conn.worker_id]
                coord.on_closed(conn.worker_id)
            return
        try:
            msg = decode(raw)
        except ProtocolError as e:
            log.warning("closing a control connection: %s", e)
            conn.hang_up()
            return
        if conn in self._agent_of or isinstance(msg, AgentHello):
            self._from_agent(conn, msg, now)
            self._execute()
            return
        late = isinstance(msg, Hello) and msg.term > 0 and not coord.awaits_late_hello(msg.worker_id)
        if isinstance(msg, Vote) or late:
            # a vote or a reconnect after a failover: one that arrives once the new coordinator
            # has rebuilt its state is too late (its process was not vouched for), except from a
            # spare that was starting then (it had no connection to lose; rebuild.py kept it)
            conn.hang_up()
            return
        if isinstance(msg, Hello):
            if conn.worker_id is not None or not coord.on_connected(msg.worker_id, now):
                conn.hang_up()  # a process we did not start (or of a lost host), or a second hello
            else:
                conn.worker_id = msg.worker_id
                self._conns[msg.worker_id] = conn
                host = coord.procs[msg.worker_id].host
                if host in self._agents:
                    self._agents[host].send(encode(ProcConnected(msg.worker_id)))
                elif agent is not None:
                    agent.mark_connected(msg.worker_id)
                self._announce(conn)
                if msg.term > 0 and msg.ready:
                    # a spare that was starting at the failover: its SpareReady went nowhere
                    # (it had nobody to send it to); its hello says it instead
                    coord.on_message(msg.worker_id, SpareReady(), now, time.time())
            self._execute()
            return
        if conn.worker_id is None or self._conns.get(conn.worker_id) is not conn:
            return  # nothing but hello before a connection has said who it is
        coord.on_message(conn.worker_id, msg, now, time.time())
        self._execute()

    def _execute(self) -> None:
        """Carry out what the coordinator decided, in order."""
        coord, agent = self.coordinator, self.agent
        assert coord is not None
        while commands := coord.drain():
            for c in commands:
                if isinstance(c, Send):
                    conn = self._conns.get(c.worker_id)
                    if conn is not None:
                        conn.send(encode(c.message))
                elif isinstance(c, Spawn):
                    if c.host in self._agents:
                        self._agents[c.host].send(encode(SpawnCmd(c.worker_id, c.role)))
                    elif agent is not None and c.host == self._local_host:
                        coord.on_started(c.worker_id, agent.spawn(c.worker_id, c.role))
                elif isinstance(c, HostTable):
                    # before the plans that name its version go out, in this same pass: the
                    # embedded agent has the file written by then; a remote one gets the chunks
                    # first on its own connection
                    for chunk in c.chunks:
                        if c.host in self._agents:
                            self._agents[c.host].send(encode(chunk))
                        elif agent is not None and c.host == self._local_host:
                            agent.on_table_chunk(chunk)
                elif isinstance(c, Kill):
                    if c.host in self._agents:
                        self._agents[c.host].send(encode(KillCmd(c.worker_id, c.why)))
                    elif agent is not None and c.host == self._local_host:
                        agent.kill(c.worker_id, c.why)
                elif isinstance(c, Emit):
                    self.events.emit(c.event, **c.fields)
                elif isinstance(c, Log):
                    log.log(_LEVELS.get(c.level, logging.INFO), "%s", c.text)
                elif isinstance(c, Stop):
                    self.stopping = c.why
                    self.exit_code = c.code
        changed = False
        for host, conn in list(self._agents.items()):
            if not coord.host_alive(host):  # fenced: cut it off; it rejoins as a new agent
                del self._agents[host]
                conn.hang_up()
                changed = True
        if changed:
            self._announce()  # the membership a majority is counted against has shrunk
