"""The launcher's side of the remote agents and of who succeeds the coordinator.

A mixin of :class:`~checkpointless.launcher.launcher.Launcher` (and so of the takeover shell):
waiting for the job's hosts, an agent's hello and reports, the welcome it gets, the lease beats,
the succession sent to agents and workers, stepping down without a majority, and releasing the
agents at the end. The attributes it reads are the launcher's, declared below for the type
checker; the control server stays in ``launcher.py``, the decision loop is in ``loop.py``.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.agent import Agent
from checkpointless.coordinator import Coordinator
from checkpointless.coordinator.rules.election import HostSeen, keeps_majority, membership
from checkpointless.events import EventLog, get_logger
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.model import LaunchConfig, config_to_json
from checkpointless.protocol import (
    AgentHeartbeat,
    AgentHello,
    AgentRefused,
    AgentWelcome,
    ProcExited,
    ProcStarted,
    ProcVerdict,
    ProtocolError,
    Shutdown,
    Succession,
    encode,
)
from checkpointless.protocol.agent_link import SHM_KEY_LABEL
from checkpointless.protocol.beats import beats_of
from checkpointless.wire import seal_value

__all__ = ["AgentHosts", "claimed_host"]

log = get_logger()


def _beat_agents(agents: dict[int, Connection], stop: threading.Event) -> None:
    """The coordinator's side of the lease, on a thread of its own: a decision loop busy for a
    few seconds (starting a process, a slow disk) must not make every agent fence its host."""
    while not stop.wait(0.5):
        for conn in list(agents.values()):
            conn.send(encode(AgentHeartbeat(time.time())))


def claimed_host(live: list[tuple[int, str, str | None, str | None]], hello: AgentHello) -> int | None:
    """The live host whose address and node ``hello`` claims, if another agent serves it: None
    when they are free or the hello comes from that host's own agent again.

    ``live`` is each live host's id, address, failover address (None where it has none: the
    coordinator's own host) and node name (None where unknown: hosts a successor inherited). An
    agent's failover address is its own listening socket, bound once per agent process, so the
    same one is the same agent rejoining after its host was fenced (its old host not yet declared
    lost); any other is a second agent on a host that already has one, whose processes would
    share that host's ports and name. The node name keeps apart hosts that share an address on
    purpose: several Slurm nodes on one machine (one slurmd each). A host whose node is unknown
    is never claimed: refusing a real host would cost the job a spare, a missed duplicate only
    a warning's worth."""
    for host, address, failover, node in live:
        if address != hello.host or node is None or node != hello.node:
            continue
        if not (failover and failover == hello.failover):
            return host
    return None


class AgentHosts:
    """The agents and the succession of a :class:`Launcher` (which sets every attribute here)."""

    cfg: LaunchConfig
    job_id: str
    run_dir: Path
    shm_key: str
    events: EventLog
    server: ControlServer
    coordinator: Coordinator | None
    agent: Agent | None
    stopping: str | None
    exit_code: int
    term: int
    _signal: int | None
    _conns: dict[int, Connection]  # worker id -> its control connection
    _agents: dict[int, Connection]  # agent (host) id -> a remote agent's connection
    _agent_of: dict[Connection, int]
    _next_host: int
    _failover: dict[int, str]  # agent id -> the address it serves the control channel on
    _node: dict[int, str]  # agent id -> its node name (AgentHello.node), for claimed_host
    _stepped_down: bool
    _announced: list[int]  # the membership last sent to everyone

    if TYPE_CHECKING:  # the decision loop's, in loop.py

        def _execute(self) -> None: ...

        def _drain_inbox(self) -> None: ...

    def _gather_agents(self) -> bool:
        """Wait for the job's hosts: --nnodes plus --spare-nodes agents (the embedded one counts)."""
        coord = self.coordinator
        assert coord is not None
        deadline = time.monotonic() + self.cfg.agent_wait
        log.info("waiting for %d agents on %s:%d", self.cfg.agents_needed, *self.server.address[:2])
        while len([h for h in coord.hosts.values() if not h.lost]) < self.cfg.agents_needed:
            if self._signal is not None or time.monotonic() > deadline:
                why = (
                    f"launcher received {signal.Signals(self._signal).name}"
                    if self._signal is not None
                    else f"only {len(coord.hosts)} of {self.cfg.agents_needed} agents joined within "
                    f"{self.cfg.agent_wait:.0f} s; start `checkpointless agent --coordinator "
                    f"{self.cfg.host}:{self.server.address[1]}` on each host"
                )
                coord.fail(why)
                self._execute()
                return False
            self._drain_inbox()
            self._execute()
        return True

    def _lost_majority(self, now: float) -> bool:
        """A coordinator cut off from most of its hosts steps down (without ending the job): the
        majority may be electing a successor, and two coordinators must never act at once. Its
        own hosts' agents then lose it and fence themselves unless they join the majority's."""
        coord = self.coordinator
        if coord is None or not self._failover or not coord.started:
            return False
        if self._members(now) != self._announced:
            self._announce()  # a lost host aged out of the membership
        if keeps_majority(self._seen(), now, self.cfg.lease):
            return False
        members = membership(self._seen(), now, self.cfg.lease)
        heard = [h for h in coord.hosts.values() if not h.lost and now - h.last_seen <= self.cfg.lease]
        why = (
            f"heard from only {len(heard)} of {len(members)} hosts within the lease "
            f"({self.cfg.lease:.1f} s): no majority, stepping down so that the majority's successor "
            "is the only coordinator"
        )
        log.error("%s", why)
        self.events.emit("coordinator_step_down", term=self.term, why=why)
        self._stepped_down = True
        self.stopping = "stepped down"
        self.exit_code = 75
        return True

    def _seen(self) -> list[HostSeen]:
        coord = self.coordinator
        assert coord is not None
        return [HostSeen(h.host, h.lost, h.remote, h.last_seen) for h in coord.hosts.values()]

    def _members(self, now: float) -> list[int]:
        """The membership a majority is counted against (coordinator/rules/election.py); agents are
        told the same, so that a side of a partition that heard of its peers' loss one by one
        cannot count itself a majority either."""
        return membership(self._seen(), now, self.cfg.lease)

    def _announce(self, only: Connection | None = None) -> None:
        """Tell agents and workers who may take over (all of them, or just ``only``)."""
        coord = self.coordinator
        if coord is None:
            return
        live = sorted(h.host for h in coord.hosts.values() if not h.lost)
        successors = [h for h in live if self._failover.get(h)]
        if not successors:
            return
        members = self._members(time.monotonic())
        if only is None:
            self._announced = members
        succession = Succession(
            term=self.term,
            members=members,
            successors=successors,
            addresses=[self._failover[h] for h in successors],
            lease=self.cfg.lease,
        )
        if self.agent is not None:
            self.agent.succession = succession  # for the processes this host starts from now on
        msg = encode(succession)
        targets = [only] if only is not None else [*self._agents.values(), *self._conns.values()]
        for conn in targets:
            conn.send(msg)

    def _from_agent(self, conn: Connection, msg: Any, now: float) -> None:
        """A remote agent's hello or report (see agent/remote.py)."""
        coord = self.coordinator
        assert coord is not None
        if isinstance(msg, AgentHello):
            if conn in self._agent_of or conn.worker_id is not None or coord.stopping is not None:
                conn.hang_up()
                return
            live = [
                (h.host, h.address, self._failover.get(h.host), self._node.get(h.host))
                for h in coord.hosts.values()
                if not h.lost
            ]
            taken = claimed_host(live, msg)
            if taken is not None:
                why = (
                    f"host {msg.host} is served by agent {taken} already (live); this agent "
                    f"(pid {msg.pid} on {msg.hostname or '?'}) is a second one for the same host: "
                    "stop it, or give it this host's own address with --host"
                )
                log.warning("refused an agent from %s (%s): %s", msg.host, msg.hostname or "?", why)
                conn.send(encode(AgentRefused(why)))
                conn.hang_up()
                return
            host = self._next_host
            self._next_host += 1
            self._agent_of[conn] = host
            self._agents[host] = conn
            conn.send(encode(self._welcome(host)))
            coord.add_host(host, msg.host, True, now, msg.order)
            if msg.failover:
                self._failover[host] = msg.failover
            self._node[host] = msg.node
            log.info("agent %d joined from %s (%s)", host, msg.host, msg.hostname or "?")
            self._announce()
            return
        host = self._agent_of[conn]
        if not coord.host_alive(host):
            conn.hang_up()  # a fenced host: its reports are about ranks that moved on
            return
        coord.on_agent_seen(host, now)
        if isinstance(msg, ProcStarted):
            coord.on_started(msg.worker_id, msg.store_address)
        elif isinstance(msg, ProcExited):
            coord.on_exit(msg.worker_id, msg.code, msg.own_failure, msg.detail, msg.tail, now, time.time())
        elif isinstance(msg, ProcVerdict):
            coord.on_verdict(msg.worker_id, f"(pid {msg.pid}) {msg.why}", now)
        elif isinstance(msg, AgentHeartbeat):
            try:
                coord.on_beats(host, beats_of(msg), now)
            except ProtocolError as e:
                log.warning("closing agent %d's connection: %s", host, e)
                conn.hang_up()

    def _welcome(self, host: int) -> AgentWelcome:
        c = self.cfg
        return AgentWelcome(
            agent_id=host,
            lease=c.lease,
            job_id=self.job_id,
            control=f"{self.server.address[0]}:{self.server.address[1]}",
            run_dir=str(self.run_dir.resolve()),
            shm_key=seal_value(self.server.secret, SHM_KEY_LABEL, self.shm_key.encode()),
            script=str(Path(c.script).resolve()),
            script_args=list(c.script_args),
            nproc=c.per_node,
            rendezvous=c.rendezvous,
            port_base=c.port_base,
            port_range=c.port_range,
            hang_timeout=c.hang_timeout,
            start_timeout=c.start_timeout,
            quiet_workers=c.quiet_workers,
            fork_server=c.fork_server,
            term=self.term,
            config=config_to_json(c),
        )

    # -- the end -------------------------------------------------------------------------------
    def _release_agents(self, grace: float) -> None:
        """Tell every remote agent the job is over and wait (bounded) until they hang up, so
        that their processes are gone before the job's shared memory is removed."""
        for conn in self._agents.values():
            conn.send(encode(Shutdown(code=self.exit_code, reason=self.stopping)))
        deadline = time.monotonic() + grace
        while self._agents and time.monotonic() < deadline:
            try:
                conn, raw = self.server.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if raw.get("type") == "_closed" and conn in self._agent_of:
                self._agents.pop(self._agent_of.pop(conn), None)
